"""Model FLOPs utilisation: the devices' peak throughput (imports nothing but torch, for the GPU checks).

Devices are matched by their exact CUDA name (``torch.cuda.get_device_name``): boards of one chip differ in clocks
and power (an H100 PCIe peaks ~24% under the SXM part, an H200 NVL under the H200 SXM), so a name that is not in the
table has no figure and MFU is reported as None, never the figure of a look-alike. Add a board with its vendor figure.
"""
from __future__ import annotations

import torch

# Peak dense bf16 tensor throughput (FP32 accumulate, without 2:4 sparsity), FLOP/s, by exact CUDA device name.
# Vendor datasheets quote the sparse figure for Hopper and Ada parts: those are halved here.
PEAK_FLOPS = {
    "NVIDIA H200": 989.5e12,  # H200 datasheet, H200 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity
    "NVIDIA H100 80GB HBM3": 989.5e12,  # H100 datasheet, H100 SXM (the HBM3 board): 1,979 TFLOPS with sparsity
    "NVIDIA H100 PCIe": 756.5e12,  # H100 datasheet, H100 PCIe: 1,513 TFLOPS with sparsity
    "NVIDIA A100-SXM4-80GB": 312e12,  # A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), every board
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362.05e12,  # L40S datasheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity)
    "NVIDIA L4": 121e12,  # L4 datasheet: BF16 Tensor Core 242 TFLOPS with sparsity
    "NVIDIA A10": 125e12,  # A10 datasheet: BF16 Tensor Core 125 TFLOPS (250 with sparsity)
    "NVIDIA GeForce RTX 4090": 165.2e12,  # Ada Lovelace architecture whitepaper: BF16 Tensor, FP32 accumulate
    "NVIDIA GeForce RTX 3090": 71e12,  # Ampere GA102 whitepaper: BF16 Tensor, FP32 accumulate
}


def device_name(device: torch.device) -> str | None:
    """The CUDA device's name as the driver reports it; None off CUDA."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def peak_flops_of(name: str | None) -> float | None:
    """The table's figure for exactly this device name (None: not in the table, or no CUDA device)."""
    return PEAK_FLOPS.get(name) if name is not None else None


def device_peak_flops(device: torch.device) -> float | None:
    return peak_flops_of(device_name(device))


def peak_flops_report(device: torch.device) -> str:
    """One line saying which peak MFU is computed against, or why it is not computed."""
    name = device_name(device)
    if name is None:
        return f"mfu: none on {device.type} (peak figures are for CUDA devices)"
    peak = peak_flops_of(name)
    if peak is None:
        return (f"mfu: none: unknown device {name!r} (no exact entry in pipeline/train/mfu.py PEAK_FLOPS; add its "
                f"vendor dense bf16 figure there)")
    return f"mfu: against {peak / 1e12:g} TFLOP/s per device, the dense bf16 peak of {name!r}"
