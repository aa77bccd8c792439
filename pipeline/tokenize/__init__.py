"""Stage 1: sources -> tokenizer -> shard writer -> manifest."""

__all__ = ["tokenize"]


def __getattr__(name):
    # the stage on first use: training imports pipeline.tokenize.writer and .bpe, and must not pull in the stage's
    # tiktoken, zstandard and tqdm with them (bench/gpu_check.py trains on a GPU image that has none of them)
    if name == "tokenize":
        from pipeline.tokenize.stage import tokenize

        return tokenize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
