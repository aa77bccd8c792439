"""The MFU peak comes from an exact device name: a board missing from the table has no figure (MFU None), never the
figure of the part whose name it contains."""
from __future__ import annotations

import pytest
import torch

from pipeline.train import mfu

CUDA = torch.device("cuda", 0)  # a device object only: nothing touches a GPU here


@pytest.fixture
def named(monkeypatch):
    def set_name(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return set_name


@pytest.mark.parametrize("name, sparse_tflops", [
    ("NVIDIA H200", 1979),  # vendor datasheets quote bf16 with 2:4 sparsity: the dense peak is half
    ("NVIDIA H100 80GB HBM3", 1979),
    ("NVIDIA H100 PCIe", 1513),
    ("NVIDIA L4", 242),
])
def test_known_boards_get_their_own_dense_figure(named, name, sparse_tflops):
    named(name)
    assert mfu.device_peak_flops(CUDA) == sparse_tflops / 2 * 1e12
    report = mfu.peak_flops_report(CUDA)
    assert f"{sparse_tflops / 2:g} TFLOP/s" in report and repr(name) in report


@pytest.mark.parametrize("name", ["NVIDIA H200 NVL", "NVIDIA H100 NVL", "NVIDIA A10G", "NVIDIA GH200 480GB",
                                  "Tesla V100-SXM2-16GB", "NVIDIA H200 "])
def test_boards_not_in_the_table_get_no_figure(named, name):
    """Each of these contains a table entry's name (or is a board of it): substring matching gave them that part's
    peak (H200 NVL and H100 NVL the SXM figure)."""
    named(name)
    assert mfu.device_peak_flops(CUDA) is None
    assert mfu.peak_flops_report(CUDA).startswith(f"mfu: none: unknown device {name!r}")


def test_no_figure_off_cuda():
    assert mfu.device_peak_flops(torch.device("cpu")) is None
    assert mfu.peak_flops_report(torch.device("cpu")) == "mfu: none on cpu (peak figures are for CUDA devices)"
