"""Token shards, their document indexes, and the manifest that describes them.

A shard ``{split}_{i:06d}.bin`` is raw little-endian ``uint16`` (``uint32`` for vocabularies over 65,536) holding
exactly ``shard_tokens`` tokens (the last of a split may hold fewer); ``{split}_{i:06d}.idx`` is ``uint32`` offsets of
the documents that start in it. Both are written under a temporary name and renamed when complete, so a partial
shard is never visible under its final name.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 2


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Appends documents' tokens to fixed-size shards of one split."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, np.dtype(dtype)
        self.shards: list[dict] = []
        self.documents = 0
        self._buf = np.empty(shard_tokens, dtype=self.dtype)
        self._fill = 0
        self._starts: list[int] = []  # offsets of documents starting in the open shard

    def add_document(self, tokens: np.ndarray) -> bool:
        """Append one document; True when at least one shard was completed by it."""
        completed = False
        self.documents += 1
        self._starts.append(self._fill)
        while tokens.size:
            n = min(self.shard_tokens - self._fill, tokens.size)
            self._buf[self._fill:self._fill + n] = tokens[:n]
            self._fill += n
            tokens = tokens[n:]
            if self._fill == self.shard_tokens:
                self._flush()
                completed = True
        return completed

    def _flush(self) -> None:
        if not self._fill:
            return
        # a view, not a copy: the open shard's buffer is written and hashed in place
        data = memoryview(self._buf[:self._fill].astype(self.dtype.newbyteorder("<"), copy=False)).cast("B")
        index = np.asarray(self._starts, dtype="<u4").tobytes()
        name = f"{self.split}_{len(self.shards):06d}"
        atomic_write(self.out_dir / f"{name}.idx", index)
        atomic_write(self.out_dir / f"{name}.bin", data)
        self.shards.append({"file": f"{name}.bin", "tokens": self._fill, "documents": len(self._starts),
                            "sha256": hashlib.sha256(data).hexdigest(), "index_file": f"{name}.idx",
                            "index_sha256": hashlib.sha256(index).hexdigest()})
        self._fill, self._starts = 0, []

    def close(self) -> dict:
        self._flush()
        return {"tokens": sum(s["tokens"] for s in self.shards), "documents": self.documents, "shards": self.shards}

    # ------------------------------------------------------------------------ resume: the open shard's contents
    def snapshot(self, folder: Path, tag: int) -> dict:
        """Save the open shard as ``{split}.partial.{tag}``; the returned dict goes into the job's state file."""
        name = f"{self.split}.partial.{tag}"
        atomic_write(folder / name, memoryview(self._buf[:self._fill]).cast("B"))
        return {"shards": self.shards, "documents": self.documents, "fill": self._fill, "starts": self._starts,
                "partial": name}

    def restore(self, folder: Path, state: dict) -> None:
        self.shards, self.documents = state["shards"], state["documents"]
        self._fill, self._starts = state["fill"], list(state["starts"])
        data = np.frombuffer((folder / state["partial"]).read_bytes(), dtype=self.dtype)
        if data.size != self._fill:
            raise ValueError(f"{folder}: the saved open shard of {self.split} has {data.size} tokens, expected "
                             f"{self._fill}; delete {folder} to start the tokenization over")
        self._buf[:self._fill] = data


def write_manifest(out_dir: Path, manifest: dict) -> None:
    atomic_write(out_dir / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


# What the readers (training, `grt data stats|verify`, tracking) take from a manifest: a damaged one is refused by
# read_manifest with every problem named, never met later as a KeyError or TypeError. A dict is a JSON object with
# these keys (others are allowed), [spec] a list of them, _Each(spec) an object of any keys with values like spec.
class _Each:
    def __init__(self, spec):
        self.spec = spec


_COUNT = "a count"  # a JSON integer >= 0
_SKIPPED = _Each(_COUNT)
_SHARD_SPEC = {"file": str, "tokens": _COUNT, "documents": _COUNT, "sha256": str, "index_file": str,
               "index_sha256": str}
_MANIFEST_SPEC = {
    "format_version": int,
    "tokenizer": {"name": str, "vocab_hash": str, "n_vocab": _COUNT, "eot_id": _COUNT},
    "dtype": str,
    "shard_tokens": _COUNT,
    "splits": _Each({"tokens": _COUNT, "documents": _COUNT, "shards": [_SHARD_SPEC]}),
    "sources": [{"kind": str, "paths": [str], "name": (str, type(None)), "documents": _COUNT, "bytes": _COUNT,
                 "tokens": _COUNT, "duplicates": _COUNT, "skipped": _SKIPPED}],
    "totals": {"documents": _COUNT, "tokens": _COUNT, "bytes": _COUNT, "duplicates": _COUNT, "skipped": _SKIPPED},
}
DTYPES = {"uint16": 2**16, "uint32": 2**32}  # shard dtype -> the most token ids it can hold


def _json_kind(value) -> str:
    for t, name in ((dict, "an object"), (list, "an array"), (str, "a string"), (bool, "a boolean"),
                    (int, "an integer"), (float, "a number")):
        if isinstance(value, t):
            return name
    return "null"


def _spec_problems(value, spec, where: str, out: list[str]) -> None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            out.append(f"{where} is {_json_kind(value)}, not an object")
            return
        for key, sub in spec.items():
            if key not in value:
                out.append(f"{where}.{key} is missing")
            else:
                _spec_problems(value[key], sub, f"{where}.{key}", out)
    elif isinstance(spec, (list, _Each)):
        container = list if isinstance(spec, list) else dict
        if not isinstance(value, container):
            out.append(f"{where} is {_json_kind(value)}, not {'an array' if container is list else 'an object'}")
            return
        items = enumerate(value) if container is list else value.items()
        sub = spec[0] if container is list else spec.spec
        for key, v in items:
            _spec_problems(v, sub, f"{where}[{key}]" if container is list else f"{where}.{key}", out)
    elif spec is _COUNT:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            out.append(f"{where} is {value!r}, not a count")
    elif isinstance(value, bool) or not isinstance(value, spec):
        want = " or ".join(_json_kind(t()) if t is not type(None) else "null"
                           for t in (spec if isinstance(spec, tuple) else (spec,)))
        out.append(f"{where} is {value!r}, not {want}")


def manifest_problems(m) -> list[str]:
    """What is wrong with a parsed manifest (empty: every field the readers use is there, of the right type)."""
    if not isinstance(m, dict):
        return [f"it holds {_json_kind(m)}, not the manifest's object"]
    if m.get("format_version") != FORMAT_VERSION:
        return [f"format_version {m.get('format_version')!r} is not {FORMAT_VERSION}"]
    out: list[str] = []
    _spec_problems(m, _MANIFEST_SPEC, "manifest", out)
    out = [p.removeprefix("manifest.") for p in out]
    n_vocab = m["tokenizer"].get("n_vocab") if isinstance(m.get("tokenizer"), dict) else None
    if isinstance(m.get("dtype"), str) and m["dtype"] not in DTYPES:
        out.append(f"dtype {m['dtype']!r} is not one of {sorted(DTYPES)}")
    elif m.get("dtype") in DTYPES and isinstance(n_vocab, int) and not 0 < n_vocab <= DTYPES[m["dtype"]]:
        out.append(f"tokenizer.n_vocab {n_vocab} is not between 1 and {DTYPES[m['dtype']]:,} (what {m['dtype']} "
                   f"holds)")
    if isinstance(m.get("splits"), dict):
        out += [f"splits.{s} is missing" for s in ("train", "val") if s not in m["splits"]]
        for split, info in m["splits"].items():
            shards = info.get("shards") if isinstance(info, dict) else None
            for i, sh in enumerate(shards if isinstance(shards, list) else []):
                for key in ("file", "index_file"):
                    name = sh.get(key) if isinstance(sh, dict) else None
                    # a shard is a file of the dataset folder: no path may point anywhere else
                    if isinstance(name, str) and (name in ("", ".", "..") or "/" in name or "\\" in name):
                        out.append(f"splits.{split}.shards[{i}].{key} {name!r} is not a file name")
    return out


def read_manifest(dataset_dir: str | Path) -> dict:
    """The manifest of a tokenized dataset; a missing, unreadable or incomplete one is an error naming the file."""
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no tokenized dataset at {dataset_dir} ({MANIFEST} missing): run "
                                f"`grt tokenize RECIPE` first, or point data.dataset_dir at a tokenized dataset")
    fix = "re-tokenize the dataset with `grt tokenize RECIPE --force`"
    try:
        manifest = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): damaged or cut "
                         f"short; {fix}") from None
    except (ValueError, RecursionError) as e:  # not UTF-8 text; nested past the parser's depth
        raise ValueError(f"{path} cannot be read as JSON ({type(e).__name__}: {e}); {fix}") from None
    problems = manifest_problems(manifest)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"{path} is not a usable manifest: {'; '.join(problems[:5])}{more}; {fix}")
    return manifest


def scan_shard(path: Path, dtype: str, n_vocab: int | None, checksum: bool = True,
               block_bytes: int = 1 << 24) -> dict:
    """One pass over a shard file in blocks of ``block_bytes`` (memory stays bounded): its sha256 (when ``checksum``)
    and, when ``n_vocab`` is given, how many token ids are >= n_vocab, the first one's token offset and value."""
    dt = np.dtype(dtype).newbyteorder("<")
    h = hashlib.sha256() if checksum else None
    buf = bytearray(block_bytes - block_bytes % dt.itemsize)
    bad, first, value, offset = 0, None, None, 0
    with open(path, "rb") as fh:
        while n := fh.readinto(buf):
            if h is not None:
                h.update(memoryview(buf)[:n])
            if n_vocab is not None:
                ids = np.frombuffer(buf, dtype=dt, count=n // dt.itemsize)  # a trailing partial token: size check
                if ids.size and ids.max() >= n_vocab:
                    where = np.flatnonzero(ids >= n_vocab)
                    if first is None:
                        first, value = offset + int(where[0]), int(ids[where[0]])
                    bad += where.size
            offset += n // dt.itemsize
    return {"sha256": h.hexdigest() if h is not None else None, "bad_ids": bad, "first_bad": first,
            "first_bad_value": value}


def bad_ids_text(file: str, scan: dict, n_vocab: int, limit_words: str = "the vocabulary size") -> str:
    """One line on a shard's token ids out of range (``scan`` from :func:`scan_shard`)."""
    return (f"{file} holds {scan['bad_ids']:,} token id(s) >= {limit_words} {n_vocab:,}, the first "
            f"({scan['first_bad_value']}) at token offset {scan['first_bad']:,}")


def shard_size_problem(name: str, size: int, tokens: int, itemsize: int) -> str | None:
    """A shard file of ``size`` bytes against the manifest's ``tokens``: the mismatch in words, or None."""
    if size == tokens * itemsize:
        return None
    stray = f" and {size % itemsize} stray byte(s)" if size % itemsize else ""
    return (f"{name} holds {size // itemsize:,} tokens{stray} ({size:,} bytes), the manifest says {tokens:,} "
            f"({tokens * itemsize:,} bytes)")


def verify_dataset(dataset_dir: str | Path, checksums: bool = True) -> list[str]:
    """Recheck every shard and index against the manifest; returns the problems (empty: all good). With ``checksums``
    every file's sha256 and every token id (below the tokenizer's n_vocab) are checked, in one read of the data;
    ``checksums=False`` checks only sizes and indexes: a quick look at a very large dataset."""
    d = Path(dataset_dir)
    m = read_manifest(d)
    itemsize = np.dtype(m["dtype"]).itemsize
    n_vocab = m["tokenizer"]["n_vocab"]
    problems = []
    tok_file = m["tokenizer"].get("file")  # the copy of a user tokenizer (pipeline/tokenize/tokenizers.py)
    if tok_file and not (d / tok_file).is_file():
        problems.append(f"tokenizer: {tok_file} is missing")
    elif tok_file and checksums and hashlib.sha256((d / tok_file).read_bytes()).hexdigest() != m["tokenizer"][
            "vocab_hash"]:
        problems.append(f"tokenizer: {tok_file} sha256 differs from the manifest's vocab_hash")
    for split, info in m["splits"].items():
        total_tokens = total_docs = 0
        for sh in info["shards"]:
            for key, sha_key in (("file", "sha256"), ("index_file", "index_sha256")):
                f = d / sh[key]
                if not f.is_file():
                    problems.append(f"{split}: {sh[key]} is missing")
                    continue
                if not checksums:
                    continue
                scan = scan_shard(f, m["dtype"] if key == "file" else "<u4", n_vocab if key == "file" else None)
                if scan["sha256"] != sh[sha_key]:
                    problems.append(f"{split}: {sh[key]} sha256 {scan['sha256'][:16]} != manifest {sh[sha_key][:16]}")
                if scan["bad_ids"]:
                    problems.append(f"{split}: " + bad_ids_text(sh[key], scan, n_vocab,
                                                                "the tokenizer's vocabulary size (n_vocab)"))
            f = d / sh["file"]
            wrong_size = f.is_file() and shard_size_problem(sh["file"], f.stat().st_size, sh["tokens"], itemsize)
            if wrong_size:
                problems.append(f"{split}: {wrong_size}")
            idx = d / sh["index_file"]
            if idx.is_file():
                starts = np.fromfile(idx, dtype="<u4", count=idx.stat().st_size // 4)
                if starts.size != sh["documents"] or (starts.size and (np.any(np.diff(starts.astype(np.int64)) <= 0)
                                                                       or starts[-1] >= sh["tokens"])):
                    problems.append(f"{split}: {sh['index_file']} is not {sh['documents']} increasing offsets "
                                    f"below {sh['tokens']}")
            total_tokens += sh["tokens"]
            total_docs += sh["documents"]
        if total_tokens != info["tokens"]:
            problems.append(f"{split}: shards hold {total_tokens} tokens, manifest total says {info['tokens']}")
        if total_docs != info["documents"]:
            problems.append(f"{split}: shard indexes list {total_docs} documents, manifest says {info['documents']}")
    return problems
