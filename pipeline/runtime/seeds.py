"""One way to turn a few named parts into a 64-bit seed, the same on every rank and every run."""
import hashlib


def derive_seed(*parts) -> int:
    """The parts as text joined by ":", hashed with sha256: the first 8 bytes, little-endian, as an int."""
    text = ":".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
