"""Whether a tokenized dataset can feed a recipe's model: shared by training, evaluation and the preflight."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.tokenize.dataset_cache import local_tokenizer_folder
from pipeline.tokenize.tokenizers import saved_tokenizer
from pipeline.tokenize.tokenizers import tokenizer_identity

if TYPE_CHECKING:
    from pipeline.config import RunConfig


def check_dataset_matches_model(manifest: dict, cfg: RunConfig, where: str = "the dataset",
                                model_tokenizer: dict | None = None) -> None:
    """Refuse a dataset whose tokenizer differs from the recipe's (``model_tokenizer``: the identity of the one a
    checkpoint was trained with) or cannot feed this model, naming both values."""
    tok = manifest["tokenizer"]
    spec = cfg.data.tokenizer
    # a file named by the recipe is read there; once moved, the copy the dataset keeps stands in for it
    if model_tokenizer is not None:
        want = model_tokenizer
    elif spec == "gpt2" or Path(spec).expanduser().is_file():
        want = tokenizer_identity(spec, cfg.data.tiktoken_pattern)
    else:  # an s3:// dataset's copy is read from the node cache (only that file is downloaded for it)
        folders = [local_tokenizer_folder(d) for d in cfg.data.training_datasets()[0]]
        want = saved_tokenizer(spec, folders, cfg.data.tiktoken_pattern).identity()
    problems = [f"{key}: dataset {tok.get(key)!r} != recipe's {cfg.data.tokenizer} tokenizer {want.get(key)!r}"
                for key in ("name", "vocab_hash", "n_vocab", "eot_id", "pattern") if tok.get(key) != want.get(key)]
    if tok["n_vocab"] > cfg.model.vocab_size:
        problems.append(f"vocabulary size: dataset {tok['n_vocab']} token ids > model.vocab_size="
                        f"{cfg.model.vocab_size}")
    if problems:
        raise ValueError(f"{where} does not fit this recipe: " + "; ".join(problems) +
                         ". Re-tokenize it with the recipe's tokenizer (grt tokenize RECIPE --force) or fix "
                         "model.vocab_size / data.tokenizer.")
