"""Model FLOPs utilisation: the devices' peak throughput (imports nothing but torch, for the GPU checks)."""
from __future__ import annotations

import torch

# Peak dense bf16 tensor throughput per device, FLOP/s, for MFU (vendor figures, without sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
              "V100": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
