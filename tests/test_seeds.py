"""derive_seed gives the integers the four hand-written sha256 keys gave (checkpoints and tests were made with them)."""
import hashlib

from pipeline.runtime.seeds import derive_seed


def _old(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def test_derive_seed_matches_the_keys_it_replaced():
    assert derive_seed("init", 1337, "blocks.0.attn.qkv.weight") == _old("init:1337:blocks.0.attn.qkv.weight")
    assert derive_seed("noise", 1337, 12, 3) == _old("noise:1337:12:3")
    assert derive_seed("depth", 7, 40) == _old("depth:7:40")
    assert derive_seed("depth", 7, 40, 2) == _old("depth:7:40:2")
    assert derive_seed("poisson-depth", 0, 5) == _old("poisson-depth:0:5")
    assert derive_seed("poisson-depth", 0, 5, 1) == _old("poisson-depth:0:5:1")


def test_derive_seed_call_sites():
    from pipeline.model.layers import param_seed
    from pipeline.train.trainer import step_seed
    assert param_seed(1337, "wte.weight") == _old("init:1337:wte.weight")
    assert step_seed(5, 100, 7) == _old("noise:5:100:7")
    assert 0 <= derive_seed("x") < 1 << 64
