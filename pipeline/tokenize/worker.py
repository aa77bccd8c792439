"""The work done in each tokenizer process: decode and check raw records, hash and tokenize the documents."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from dataclasses import field

import numpy as np

from pipeline.runtime.locking import forked_child_cleanup
from pipeline.tokenize.sources import SKIP_REASONS
from pipeline.tokenize.sources import parse_record
from pipeline.tokenize.sources import record_fields
from pipeline.tokenize.tokenizers import load_tokenizer

BLANK = -1  # a record with no document (blank JSON line): neither counted nor kept
DOC = 0  # kinds 1.. are 1 + the index of the skip reason in SKIP_REASONS


@dataclass
class BatchResult:
    kinds: np.ndarray  # int8 per record
    hashes: np.ndarray  # uint64 per document: hash of the whitespace-normalised text (dedup and split)
    ntokens: np.ndarray  # int64 per document, EOT included
    nbytes: np.ndarray  # int64 per document: UTF-8 bytes of its text
    tokens: np.ndarray  # all documents' tokens, each followed by EOT
    # per record that lacks the text field, in order: its fields (a JSON object's keys; () for other records). Per
    # record, not per batch, so the main process counts them record by record, as it counts the skip itself: a
    # state saved mid-batch then holds both counts up to the same record.
    missing_fields: list[tuple[str, ...]] = field(default_factory=list)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def init_worker(parent_pid: int) -> None:
    """Initializer of a tokenizer process: drop the dataset lock inherited by fork (it must die with the job, not
    outlive it in a worker), and end when the job's process ends, however it ends (SIGKILL included)."""
    forked_child_cleanup()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    else:  # no parent-death signal: watch for the parent's end
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # the parent ended before the signal was set up
        os._exit(1)


def content_hash(text: str) -> int:
    """64-bit hash of the text with whitespace runs collapsed: equal for documents that differ only in spacing."""
    norm = " ".join(text.split())
    return int.from_bytes(hashlib.blake2b(norm.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=None)
def _tokenizer(spec: str, pattern: str | None):
    return load_tokenizer(spec, pattern)  # once per process: a file tokenizer is read and hashed once


def process_batch(records: list[tuple], text_field: str, dtype: str, tokenizer: str = "gpt2",
                  pattern: str | None = None) -> BatchResult:
    tok = _tokenizer(tokenizer, pattern)
    eot = tok.eos_id
    kinds, texts = [], []
    fields: list[tuple[str, ...]] = []
    for raw, fmt in records:
        if fmt == "blank":
            kinds.append(BLANK)
            continue
        text, reason = parse_record(raw, fmt, text_field)
        if reason is not None:
            kinds.append(1 + SKIP_REASONS.index(reason))
            if reason == "missing_text_field":
                fields.append(tuple(record_fields(raw, fmt)))
            continue
        kinds.append(DOC)
        texts.append(text)
    flat: list[int] = []
    ntokens = []
    for ids in map(tok.encode, texts):
        flat.extend(ids)
        flat.append(eot)  # end-of-text after every document
        ntokens.append(len(ids) + 1)
    return BatchResult(kinds=np.asarray(kinds, dtype=np.int8),
                       hashes=np.asarray([content_hash(t) for t in texts], dtype=np.uint64),
                       ntokens=np.asarray(ntokens, dtype=np.int64),
                       nbytes=np.asarray([len(t.encode("utf-8", "surrogatepass")) for t in texts], dtype=np.int64),
                       tokens=np.asarray(flat, dtype=dtype), missing_fields=fields)
