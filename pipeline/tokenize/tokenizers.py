"""The tokenizer named by ``data.tokenizer``: ``gpt2`` (GPT-2's BPE, :mod:`pipeline.tokenize.bpe`), a Hugging Face
``tokenizer.json``, or a tiktoken BPE rank file (``*.tiktoken``, the format tiktoken's ``load_tiktoken_bpe`` reads).

One interface for every stage that turns text into ids or back: ``encode`` (no special tokens), ``decode``,
``token_bytes``, ``n_vocab``, ``eos_id`` (written after every document), ``bos_id`` (None where the tokenizer has
none; documents get no BOS, see docs/data.md) and ``identity()`` (what a manifest records). A file tokenizer's
identity hash is the sha256 of the file (a tiktoken file's identity adds its split pattern). A dataset keeps a copy
of the file (:data:`FILES`) and a run folder another, so eval, generate, export and lm-eval load the same one after
the user's original path moved.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import shutil
from pathlib import Path

from pipeline.tokenize.bpe import EOT_TOKEN
from pipeline.tokenize.bpe import tokenizer_identity as gpt2_identity

GPT2 = "gpt2"
FILES = {"hf": "tokenizer.json", "tiktoken": "tokenizer.tiktoken"}  # kind -> the copy's name in a dataset/run folder
# Special tokens looked up in a tokenizer.json's added tokens, first found wins; `grt tokenizer train` writes the first.
EOS_NAMES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
BOS_NAMES = ("<|startoftext|>", "<|begin_of_text|>", "<s>", "<bos>")
# A tiktoken rank file holds only the merges. One of tiktoken's public encodings (known by the file's sha256) brings
# its own split pattern and <|endoftext|> id; any other file needs data.tiktoken_pattern and gets <|endoftext|> right
# after its last rank. No BOS either way.
PATTERN_KEY = "data.tiktoken_pattern"


@functools.lru_cache(maxsize=None)
def known_encodings() -> dict[str, dict]:
    """tiktoken's registered public encodings that load a rank file: name -> {sha256, pattern, eos_id}.

    Read from tiktoken_ext.openai_public's own constructors, with its loader swapped for one that returns no ranks:
    tiktoken keeps the expected hashes and most patterns inside those functions (only r50k's is a module constant),
    and a real call would download the file. An encoding built otherwise (gpt2: data-gym files) is left out."""
    try:
        from tiktoken_ext import openai_public as op
    except ImportError:
        return {}

    class _NotARankFile(Exception):
        pass

    seen: list[str] = []

    def rank_file(url, expected_hash=None, **_):
        seen.append(expected_hash)
        return {}

    def other_files(*_, **__):
        raise _NotARankFile

    saved = op.load_tiktoken_bpe, op.data_gym_to_mergeable_bpe_ranks
    op.load_tiktoken_bpe, op.data_gym_to_mergeable_bpe_ranks = rank_file, other_files
    out = {}
    try:
        for name, make in op.ENCODING_CONSTRUCTORS.items():
            seen.clear()
            try:
                spec = make()
            except _NotARankFile:
                continue
            eos = spec["special_tokens"].get(EOT_TOKEN)
            if len(seen) == 1 and seen[0] and eos is not None:
                out[name] = {"sha256": seen[0], "pattern": spec["pat_str"], "eos_id": eos}
    finally:
        op.load_tiktoken_bpe, op.data_gym_to_mergeable_bpe_ranks = saved
    return out


def known_encoding(digest: str) -> str | None:
    """The name of tiktoken's public encoding whose rank file has this sha256 (the first registered), else None."""
    return next((name for name, e in known_encodings().items() if e["sha256"] == digest), None)


def resolve_pattern(pattern: str) -> str:
    """The regex ``data.tiktoken_pattern`` stands for: a known encoding's name means its pattern."""
    known = known_encodings().get(pattern)
    return known["pattern"] if known else pattern


def pattern_problems(spec: str, pattern: str | None) -> list[str]:
    """``data.tiktoken_pattern`` checked against ``data.tokenizer``: only for a tiktoken file, needed for one tiktoken
    does not know (when the file is there to hash), and a regex tiktoken compiles."""
    kind = tokenizer_kind(spec)
    if pattern is None:
        path = Path(spec).expanduser()
        if kind == "tiktoken" and path.is_file() and known_encoding(file_sha256(path)) is None:
            return [_no_pattern(spec)]
        return []
    if kind != "tiktoken":
        return [f"{PATTERN_KEY} is set but data.tokenizer={spec!r} is not a tiktoken BPE file (*.tiktoken); remove "
                f"{PATTERN_KEY}"]
    if not pattern:
        return [f"{PATTERN_KEY} is empty: name an encoding ({', '.join(known_encodings())}) or give a regex"]
    problem = _regex_problem(resolve_pattern(pattern))
    return [f"{PATTERN_KEY}={pattern!r} {problem}"] if problem else []


def _no_pattern(spec: str) -> str:
    return (f"data.tokenizer={spec} is not one of tiktoken's public encodings (by sha256), so its split pattern is "
            f"unknown; set {PATTERN_KEY} to an encoding's name ({', '.join(known_encodings())}) or a regex")


def _regex_problem(pattern: str) -> str | None:
    """Why tiktoken would not compile ``pattern`` (Rust fancy-regex syntax), else None."""
    import tiktoken

    try:
        tiktoken.Encoding(name="grt-pattern-check", pat_str=pattern, special_tokens={},
                          mergeable_ranks={bytes([b]): b for b in range(256)})
    except ValueError as e:
        return f"is not a regex tiktoken compiles ({str(e).splitlines()[0][:200]}); fix the regex"
    return None


def tokenizer_kind(spec: str) -> str | None:
    """gpt2 | hf | tiktoken for a ``data.tokenizer`` value; None for one that names none of them."""
    if spec == GPT2:
        return GPT2
    if spec.endswith(".json"):
        return "hf"
    if spec.endswith(".tiktoken"):
        return "tiktoken"
    return None


def spec_problems(spec: str) -> list[str]:
    """``data.tokenizer`` checked by its form (the file itself is read when a dataset is made)."""
    if tokenizer_kind(spec) is None:
        return [f"data.tokenizer={spec!r}: give 'gpt2', a Hugging Face tokenizer.json path (*.json) or a tiktoken BPE "
                f"file (*.tiktoken)"]
    return []


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Tokenizer:
    """Text <-> token ids for one tokenizer; built by :func:`load_tokenizer`."""

    def __init__(self, kind: str, path: str | None, vocab_hash: str, n_vocab: int, eos_id: int,
                 bos_id: int | None, impl, pattern: str | None = None):
        self.kind, self.path, self.vocab_hash = kind, path, vocab_hash
        self.n_vocab, self.eos_id, self.bos_id, self.impl = n_vocab, eos_id, bos_id, impl
        self.pattern = pattern  # a tiktoken file's split regex (None for gpt2 and tokenizer.json: theirs is inside)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` with no special token added, and special-token text read as plain text."""
        if self.kind == "hf":
            return self.impl.encode(text, add_special_tokens=False).ids
        return self.impl.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        if self.kind == "hf":
            return self.impl.decode(list(ids), skip_special_tokens=False)
        return self.impl.decode(list(ids))

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes one token stands for (a piece of a character for byte-level BPE)."""
        if self.kind == "hf":
            return _hf_token_bytes(self.impl, int(token))
        return self.impl.decode_single_token_bytes(int(token))

    def identity(self) -> dict:
        """What a dataset's manifest records; gpt2's is exactly the record older datasets have."""
        if self.kind == GPT2:
            return gpt2_identity()
        ident = {"name": self.kind, "vocab_hash": self.vocab_hash, "n_vocab": self.n_vocab, "eot_id": self.eos_id,
                 "bos_id": self.bos_id, "file": FILES[self.kind]}
        if self.pattern is not None:  # same rank file, other split = other tokens
            ident["pattern"] = self.pattern
        return ident


@functools.lru_cache(maxsize=None)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (a printable character per byte) -> the byte."""
    from tokenizers import pre_tokenizers

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = {chr(c): b for b, c in zip(bs, cs)}
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())  # the alphabet tokenizers' ByteLevel uses
    return table


def _hf_token_bytes(tok, token: int) -> bytes:
    piece = tok.id_to_token(token)
    if piece is None:
        return b""
    table = _byte_decoder()
    if type(tok.decoder).__name__ == "ByteLevel" and all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return tok.decode([token], skip_special_tokens=False).encode("utf-8")


def _special(tok, names: tuple[str, ...]) -> int | None:
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def _load_hf(path: Path, data: bytes, digest: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - the library's own words, on one line
        raise ValueError(f"data.tokenizer={path}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") \
            from None
    tok.encode_special_tokens = True  # special-token text in a document is plain text (tiktoken's encode_ordinary)
    eos = _special(tok, EOS_NAMES)
    if eos is None:
        raise ValueError(f"data.tokenizer={path} has no end-of-text token (one of {', '.join(EOS_NAMES)}) to end "
                         f"each document with; add one as a special token")
    n_vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer("hf", str(path), digest, n_vocab, eos, _special(tok, BOS_NAMES), tok)


def _load_tiktoken(path: Path, data: bytes, digest: str, pattern: str | None) -> Tokenizer:
    import tiktoken

    known = known_encodings().get(known_encoding(digest) or "")
    if pattern is None and known is None:
        raise ValueError(_no_pattern(str(path)))
    pat_str = resolve_pattern(pattern) if pattern is not None else known["pattern"]  # a stated pattern wins
    problem = _regex_problem(pat_str)
    if problem:
        raise ValueError(f"{PATTERN_KEY}={pattern!r} {problem}")

    ranks = {}
    for line in data.splitlines():  # load_tiktoken_bpe's parse, on the bytes that were hashed
        if line:
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError:
                raise ValueError(f"data.tokenizer={path}: line {line[:60]!r} is not 'base64-token rank': not a "
                                 f"tiktoken BPE file") from None
    eos = known["eos_id"] if known else max(ranks.values()) + 1
    enc = tiktoken.Encoding(name=f"grt-{digest[:12]}", pat_str=pat_str, mergeable_ranks=ranks,
                            special_tokens={EOT_TOKEN: eos})
    return Tokenizer("tiktoken", str(path), digest, max(eos, max(ranks.values())) + 1, eos, None, enc, pat_str)


@functools.lru_cache(maxsize=8)
def _load_file(path: str, digest: str, pattern: str | None) -> Tokenizer:
    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:  # changed since it was hashed
        return load_tokenizer(path, pattern)
    if tokenizer_kind(path) == "hf":
        return _load_hf(Path(path), data, digest)
    return _load_tiktoken(Path(path), data, digest, pattern)


def load_tokenizer(spec: str, pattern: str | None = None) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: ``gpt2`` or a file (cached per path and content); ``pattern`` is
    ``data.tiktoken_pattern`` (a tiktoken file's split regex or an encoding's name)."""
    if spec == GPT2:
        from pipeline.tokenize.bpe import gpt2_encoding

        ident = gpt2_identity()
        return Tokenizer(GPT2, None, ident["vocab_hash"], ident["n_vocab"], ident["eot_id"], None, gpt2_encoding())
    problems = spec_problems(spec)
    if problems:
        raise ValueError(problems[0])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer={spec}: no such file (relative paths are taken from the current "
                                f"folder); fix data.tokenizer")
    return _load_file(str(path.resolve()), file_sha256(path), pattern)


def tokenizer_identity(spec: str, pattern: str | None = None) -> dict:
    """What a dataset made with ``spec`` records about its tokenizer (gpt2's without building its encoding)."""
    return gpt2_identity() if spec == GPT2 else load_tokenizer(spec, pattern).identity()


def keep_copy(tok: Tokenizer, folder: str | Path) -> None:
    """Copy a file tokenizer into ``folder`` under :data:`FILES` (nothing for gpt2), so the folder carries it."""
    if tok.kind == GPT2:
        return
    dest = Path(folder) / FILES[tok.kind]
    if not (dest.is_file() and file_sha256(dest) == tok.vocab_hash):
        _copy(tok.path, dest)


def _copy(src: str | Path, dest: Path) -> None:
    """Copy under a temporary name and rename: a reader never sees half a file."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dest)


def saved_tokenizer(spec: str, folders: list[str | Path], pattern: str | None = None) -> Tokenizer:
    """The tokenizer a dataset or checkpoint was made with: the copy in the first of ``folders`` that has one, else
    ``spec`` itself; a one-line error when there is none. The first copy wins: a run folder's is the model's own,
    even after its dataset was re-tokenized with another file (which the dataset check then names)."""
    kind = tokenizer_kind(spec)
    if kind == GPT2 or kind is None:
        return load_tokenizer(spec, pattern)
    candidates = [Path(f) / FILES[kind] for f in folders] + [Path(spec).expanduser()]
    for path in candidates:
        if path.is_file():
            return load_tokenizer(str(path), pattern)
    raise FileNotFoundError(f"the tokenizer this model was trained with (data.tokenizer={spec}) is in none of "
                            f"{', '.join(map(str, candidates))}; put that file back at one of them")


def carry_tokenizer(spec: str, dataset_dir: str | Path, run_dir: str | Path) -> None:
    """Copy the dataset's tokenizer file into a run folder (nothing for gpt2): its checkpoints then carry it."""
    kind = tokenizer_kind(spec)
    src = Path(dataset_dir) / FILES.get(kind, "")
    if kind in FILES and src.is_file():
        _copy(src, Path(run_dir) / FILES[kind])


def trained_tokenizer(cfg, checkpoint: str | Path) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: the copy in its run folder (the checkpoint's folder or one of the
    two above it: step folder, checkpoints/, run), else its dataset's, else ``data.tokenizer`` itself."""
    folders = list(Path(checkpoint).resolve().parents)[:3] + [cfg.data.dataset_dir]
    return saved_tokenizer(cfg.data.tokenizer, folders, cfg.data.tiktoken_pattern)


def dataset_tokenizer(cfg) -> Tokenizer:
    """The tokenizer of a recipe's (first) dataset: the copy it keeps, else ``data.tokenizer`` itself."""
    from pipeline.tokenize.dataset_cache import local_dataset  # an s3:// dataset: its copy in the node cache

    return saved_tokenizer(cfg.data.tokenizer, [local_dataset(cfg.data.training_datasets()[0][0])],
                           cfg.data.tiktoken_pattern)
