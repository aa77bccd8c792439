"""Loaders that read the seven downstream tasks from local files, in the fields lm-eval's own task definitions use.

The data directory is, in order: ``--metadata '{"data_dir": "..."}'`` (lm_eval) / ``eval.task_data_dir`` (grt eval),
the environment variable ``GRT_EVAL_DATA``, or the first ``shared/data/eval`` found walking up from the working
directory and from this file. Its layout is that of ``shared/data/eval`` (see its README).

| task           | file                                                        | split      | items  |
|----------------|-------------------------------------------------------------|------------|--------|
| lambada_openai | lambada/original/lambada_test.jsonl                         | test       | 5,153  |
| hellaswag      | hellaswag/klosax_llamacpp_format/hellaswag_val_full.txt.bz2 | validation | 10,042 |
| arc_easy       | arc_easy/mosaic_icl/arc_easy.jsonl                          | test       | 2,376  |
| arc_challenge  | arc_challenge/mosaic_icl/arc_challenge.jsonl                | test       | 1,172  |
| piqa           | piqa/original/valid.jsonl + valid-labels.lst                | validation | 1,838  |
| boolq          | boolq/hf_olmo/validation.jsonl                              | validation | 3,270  |
| winogrande     | winogrande/hf_olmo/validation.jsonl (winogrande_xl)         | validation | 1,267  |
"""
from __future__ import annotations

import bz2
import json
import os
import re
from pathlib import Path

import datasets

# lm-eval's own WinoGrande prompt functions, re-exported for the task file.
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_choice as winogrande_choice
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_target as winogrande_target
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_text as winogrande_text

ENV_VAR = "GRT_EVAL_DATA"


def resolve_data_dir(explicit: str | None = None) -> Path:
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"task data directory {path} (data_dir / eval.task_data_dir) does not exist")
        return path
    if os.environ.get(ENV_VAR):
        return resolve_data_dir(os.environ[ENV_VAR])
    for start in (Path.cwd(), Path(__file__).resolve()):
        for folder in (start, *start.parents):
            if (folder / "shared" / "data" / "eval").is_dir():
                return folder / "shared" / "data" / "eval"
    raise FileNotFoundError(
        f"no downstream task data found: set {ENV_VAR}=DIR, pass --metadata '{{\"data_dir\": \"DIR\"}}' to lm_eval or "
        f"eval.task_data_dir=DIR to grt eval, where DIR is laid out like shared/data/eval")


def _file(root: Path, rel: str) -> Path:
    path = root / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the task data directory {root}")
    return path


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _split(name: str, rows: list[dict]) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows)})


# Each loader takes lm-eval's task metadata as keyword arguments (``data_dir`` among them).

def lambada(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """LAMBADA as OpenAI prepared it (lm-eval's ``lambada_openai``): ``{text}``."""
    return _split("test", _jsonl(_file(resolve_data_dir(data_dir), "lambada/original/lambada_test.jsonl")))


def hellaswag(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """All 10,042 validation items from the 6-lines-per-item text file: ``activity_label: ctx``, the gold index,
    4 endings. lm-eval builds its query as ``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``;
    the file keeps ``ctx = ctx_a + " " + ctx_b`` already preprocessed (no ``[title]``-style markers) but not the
    ctx_a / ctx_b boundary, so the capital that lm-eval gives ctx_b is restored on the context's last sentence
    fragment when it starts in lower case (ActivityNet items; WikiHow items have an empty ctx_b)."""
    path = _file(resolve_data_dir(data_dir), "hellaswag/klosax_llamacpp_format/hellaswag_val_full.txt.bz2")
    lines = bz2.open(path, "rt", encoding="utf-8").read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines is not a multiple of 6 (one item = 6 lines)")
    rows = []
    for i in range(0, len(lines), 6):
        query = _capitalize_last_fragment(lines[i].strip())
        rows.append({"query": query, "choices": [s.strip() for s in lines[i + 2:i + 6]],
                     "label": int(lines[i + 1])})
    return _split("validation", rows)


def _capitalize_last_fragment(text: str) -> str:
    label, _, ctx = text.partition(": ")
    m = re.search(r"(?:^|[.!?] )([a-z])[^.!?]*$", ctx)
    if m:
        ctx = ctx[:m.start(1)] + ctx[m.start(1)].upper() + ctx[m.start(1) + 1:]
    return f"{label}: {ctx}"


def _arc(data_dir: str | None, name: str) -> datasets.DatasetDict:
    """ARC test split ``{query: "Question: ...", choices, gold}`` -> lm-eval's fields (question, choices.text)."""
    rows = []
    for row in _jsonl(_file(resolve_data_dir(data_dir), f"{name}/mosaic_icl/{name}.jsonl")):
        q = row["query"]
        q = q[len("Question: "):] if q.startswith("Question: ") else q
        rows.append({"question": q, "choices": row["choices"], "label": int(row["gold"])})
    return _split("test", rows)


def arc_easy(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    return _arc(data_dir, "arc_easy")


def arc_challenge(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    return _arc(data_dir, "arc_challenge")


def piqa(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """The original PIQA dev files: ``{goal, sol1, sol2}`` and one label per line."""
    root = resolve_data_dir(data_dir)
    rows = _jsonl(_file(root, "piqa/original/valid.jsonl"))
    labels = _file(root, "piqa/original/valid-labels.lst").read_text().split()
    if len(labels) != len(rows):
        raise ValueError(f"piqa: {len(rows)} items but {len(labels)} labels")
    return _split("validation", [{**r, "label": int(lab)} for r, lab in zip(rows, labels)])


def boolq(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """SuperGLUE BoolQ validation: ``{question, passage, answer: bool}`` -> label 0 (no) / 1 (yes)."""
    rows = _jsonl(_file(resolve_data_dir(data_dir), "boolq/hf_olmo/validation.jsonl"))
    return _split("validation", [{"question": r["question"], "passage": r["passage"], "label": int(r["answer"])}
                                 for r in rows])


def winogrande(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """WinoGrande XL dev: ``{sentence, option1, option2, answer}``."""
    rows = _jsonl(_file(resolve_data_dir(data_dir), "winogrande/hf_olmo/validation.jsonl"))
    return _split("validation", [{k: r[k] for k in ("sentence", "option1", "option2", "answer")} for r in rows])


__all__ = ["lambada", "hellaswag", "arc_easy", "arc_challenge", "piqa", "boolq", "winogrande", "winogrande_text",
           "winogrande_target", "winogrande_choice", "resolve_data_dir"]
