"""Stage 1: sources -> tokenizer -> shard writer -> manifest."""
from pipeline.tokenize.stage import tokenize

__all__ = ["tokenize"]
