"""Inference: batched generation with a KV cache (greedy or sampled), streaming text, stop strings, early exit at
decode, and the `grt generate` command. See docs/inference.md."""
