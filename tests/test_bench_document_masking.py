"""bench/document_masking.py's counting (b) against a brute-force count of the two masks, pair by pair."""
import torch

from conftest import load_bench

bench = load_bench("document_masking", "bench_document_masking")


def brute(docs: torch.Tensor, tile: int) -> dict:
    T = docs.numel()
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    masked = causal & (docs[:, None] == docs[None, :])
    n = -(-T // tile)
    tiles = [(masked[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]) for i in range(n) for j in range(i)]
    return {"pairs_causal": int(causal.sum()), "pairs_documents": int(masked.sum()),
            "tiles_causal": n * (n + 1) // 2, "tiles_documents": sum(bool(t.any()) for t in tiles) + n,
            "full_tiles_documents": sum(bool(t.all()) for t in tiles),
            "documents": int(docs.max()) + 1}


def test_pair_and_tile_counts_equal_a_brute_force_count():
    g = torch.Generator().manual_seed(0)
    for T, tile in ((64, 8), (70, 16), (40, 40)):
        for _ in range(20):
            ends = torch.rand(T, generator=g) < 0.08
            docs = torch.cumsum(ends.long(), 0) - ends.long()
            docs = docs - docs[0]
            got = bench.mask_counts(docs, tile)
            want = brute(docs, tile)
            assert {k: got[k] for k in want} == want, (T, tile, docs.tolist())
