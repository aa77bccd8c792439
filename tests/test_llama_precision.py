"""The llama block under bf16: CPU autocast (the single/DDP path) and FSDP2's bf16 parameters on the fp32 residual
stream. RMSNorm and the rotary rotation compute in fp32; the matmuls in bf16."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.configs import MODEL_CONFIGS
from pipeline.model.layout import documents_from_eos
from pipeline.model.llama import RMSNorm
from pipeline.model.registry import build_model

EOS = 511
SHAPES = {"gpt": dict(n_layer=4), "grt": dict(n_prelude=1, n_core=2, n_coda=1, n_recurrence=4)}


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_bf16_autocast_loss_is_close_to_fp32_with_document_masking(model_type):
    """Measured over 3 batches at init (d 128, GQA 4/2, QK-norm, a document break): relative loss differences
    2.1e-6..7.8e-6 (gpt) and 4.2e-6..1.0e-5 (grt); bound 1e-4 (10x the largest)."""
    cfg = MODEL_CONFIGS[model_type](type=model_type, vocab_size=512, block_size=128, d_model=128, n_head=4,
                                    block="llama", bias=False, n_kv_head=2, qk_norm=True, **SHAPES[model_type])
    model = build_model(cfg, seed=0).eval()
    for seed in range(3):
        idx = torch.randint(0, EOS, (4, 129), generator=torch.Generator().manual_seed(seed))
        idx[:, 40] = EOS
        docs = documents_from_eos(idx[:, :-1], EOS)
        with torch.no_grad():
            fp32 = model(idx[:, :-1], idx[:, 1:], docs=docs)[1].item()
            with torch.autocast("cpu", torch.bfloat16):
                bf16 = model(idx[:, :-1], idx[:, 1:], docs=docs)[1]
        assert bf16.dtype == torch.float32  # the loss itself accumulates in fp32
        assert abs(bf16.item() - fp32) / fp32 < 1e-4, (seed, bf16.item(), fp32)


def test_rmsnorm_keeps_the_fp32_stream_under_bf16_parameters():
    """FSDP2 gathers the blocks' parameters in bf16 and leaves the residual stream fp32: RMSNorm then normalises in
    fp32 and returns fp32, against x / sqrt(mean x^2 + eps) * w written out in fp64."""
    x = torch.randn(2, 5, 64, dtype=torch.float32) * 30
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    w16 = norm.weight.detach().to(torch.bfloat16)
    norm.weight.data = w16
    y = norm(x)
    assert y.dtype == torch.float32
    x64 = x.double()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * w16.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
