"""Token corpora: load bytes or pre-tokenized ``.bin`` files into train/validation splits.

Every corpus is a pair of 1-D integer token arrays plus a vocabulary size. Byte
corpora (the built-in one, text files, directories) have ``vocab_size == 256``
and are returned as ``uint16``; ``.bin`` corpora are memory-mapped, so a
training process only reads the pages its examples touch.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from theseus.data.documents import split_documents
from theseus.data.readers import kind_of, list_inputs, read_bytes, walk_sorted
from theseus.data.shards import (
    SHARD_PATTERN,
    SPLITS,
    TOKENIZED_RECORD,
    TOKENIZER_FILE,
    is_incomplete,
    open_split,
    read_manifest,
)

BYTE_VOCAB_SIZE = 256
TOKEN_DTYPES = ("uint16", "uint32")


# The built-in corpus takes stdlib files in sorted order until about this many bytes.
BUILTIN_MAX_BYTES = 8 * 2**20
_BUILTIN_SKIP_DIRS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


@dataclass(frozen=True, eq=False)
class Corpus:
    """Train and validation token arrays (1-D, possibly ``np.memmap``) and their vocabulary."""

    train: np.ndarray
    validation: np.ndarray
    vocab_size: int
    source: str
    tokenizer: Path | None = None  # tokenizer.json of a tokenized folder; None: byte or .bin

    def fingerprint(self) -> dict[str, int]:
        """Sizes and a CRC-32 of evenly spaced samples of both splits: equal on every process
        that reads the same data, cheap for a memory-mapped file (a few pages are read)."""
        crc = 0
        for tokens in (self.train, self.validation):
            step = max(1, tokens.size // _NUM_SAMPLES)
            for start in range(0, tokens.size, step):
                crc = zlib.crc32(np.ascontiguousarray(tokens[start : start + _SAMPLE]), crc)
        return {
            "train_tokens": int(self.train.size),
            "validation_tokens": int(self.validation.size),
            "vocab_size": int(self.vocab_size),
            "sample_crc32": crc,
        }


_NUM_SAMPLES = 16
_SAMPLE = 4096


def sidecar_path(path: str | os.PathLike) -> Path:
    """The JSON file beside a ``.bin`` token file that records its vocabulary size and length."""
    return Path(f"{path}.json")


def load_corpus(
    path: str | os.PathLike | None,
    *,
    validation_fraction: float = 0.1,
    seed: int = 0,
    token_dtype: str = "uint16",
    vocab_size: int | None = None,
    text_field: str = "text",
) -> Corpus:
    """Load a corpus and split it into train and validation.

    ``path`` selects the source:

    - ``None``: the Python standard library's ``.py`` files (no download needed), split by file.
    - a directory written by ``theseus tokenize`` (it holds the ``tokens.json`` manifest): its
      shards, memory-mapped, split when it was tokenized, with its vocabulary size and
      ``tokenizer.json``. Any of its shards names the whole folder. A folder that tokenize has
      not finished is refused.
    - any other directory: the bytes of its documents (every non-hidden regular file below it is
      one, or a JSON Lines or Parquet file's records' ``text_field``), split by document as
      :mod:`theseus.data.split` says (a tail split when it holds a single text file).
    - a JSON Lines or Parquet file (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.parquet``): the
      bytes of its documents, split by document.
    - a file ending in ``.bin``: pre-tokenized ``token_dtype`` tokens, memory-mapped,
      with the last ``validation_fraction`` as validation. ``vocab_size`` defaults to the one
      recorded beside the file by :func:`write_tokens` (``FILE.bin.json``), else to max token + 1
      (one pass over the whole file, on every process).
    - any other file: its bytes (decompressed, for ``.gz`` and ``.zst``), with the last
      ``validation_fraction`` as validation.

    ``seed`` salts which documents go to validation; tail splits ignore it.
    ``token_dtype`` and ``vocab_size`` apply only to ``.bin`` files.
    """
    _check_fraction(validation_fraction)
    _check_seed(seed)
    if path is None:
        _check_byte_options(None, vocab_size)
        return _builtin_corpus(validation_fraction, seed)
    path = Path(path)
    if not path.exists():
        raise ValueError(
            f"corpus path {str(path)!r} does not exist; pass an existing text, JSON Lines or "
            "Parquet file, a folder of them, a tokenized folder or a .bin token file, or no "
            "path for the built-in corpus"
        )
    folder = path if path.is_dir() else path.parent
    if path.is_dir() or SHARD_PATTERN.fullmatch(path.name):
        if is_incomplete(folder):
            raise ValueError(
                f"{str(folder)!r} is an unfinished `theseus tokenize` output (no "
                f"{TOKENIZED_RECORD} yet); run the same tokenize command again to finish it"
            )
        if (folder / TOKENIZED_RECORD).is_file():
            return _tokenized_corpus(folder, vocab_size)  # any shard names its folder
    if path.is_dir():
        _check_byte_options(path, vocab_size)
        return _directory_corpus(path, validation_fraction, seed, text_field)
    if path.suffix == ".bin":
        return _bin_corpus(path, validation_fraction, token_dtype, vocab_size)
    _check_byte_options(path, vocab_size)
    inputs = list_inputs(path.parent, [path.name])
    if inputs and (kind_of(path) != "text" or inputs[0].compression is not None):
        return _documents_corpus(inputs, validation_fraction, seed, text_field, repr(str(path)))
    tokens = _bytes_to_tokens(_read_nonempty(path))
    train, validation = tail_split(tokens, validation_fraction)
    return Corpus(
        train, validation, BYTE_VOCAB_SIZE, f"text file {str(path)!r}, {tokens.size} bytes"
    )


def write_tokens(
    path: str | os.PathLike,
    tokens: np.ndarray,
    dtype: str = "uint16",
    *,
    vocab_size: int | None = None,
) -> None:
    """Write a 1-D token array as a raw ``.bin`` file that ``load_corpus`` memory-maps.

    Beside it, ``FILE.bin.json`` records ``vocab_size`` (default: max token + 1), the dtype and
    the token count, so that loading never scans the file.
    """
    path = Path(path)
    if path.suffix != ".bin":
        raise ValueError(
            f"token file {str(path)!r} must end in .bin so that load_corpus recognizes it"
        )
    _check_token_dtype(dtype)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D array, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
    limit = np.iinfo(dtype).max
    if tokens.min() < 0 or tokens.max() > limit:
        raise ValueError(
            f"tokens range over [{tokens.min()}, {tokens.max()}], outside [0, {limit}] of {dtype}; "
            "use dtype='uint32' for larger vocabularies"
        )
    if vocab_size is None:
        vocab_size = int(tokens.max()) + 1
    if not isinstance(vocab_size, int) or vocab_size <= int(tokens.max()):
        raise ValueError(
            f"vocab_size={vocab_size!r} must be an int above the largest token {tokens.max()}"
        )
    tokens.astype(dtype).tofile(path)
    info = {"vocab_size": vocab_size, "token_dtype": dtype, "num_tokens": int(tokens.size)}
    sidecar_path(path).write_text(json.dumps(info) + "\n")


def tail_split(tokens: np.ndarray, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split off the last ``validation_fraction`` of ``tokens``.

    Each side gets at least one token when there are two or more.
    """
    num_validation = tail_split_size(tokens.size, validation_fraction)
    return tokens[: tokens.size - num_validation], tokens[tokens.size - num_validation :]


def tail_split_size(size: int, validation_fraction: float) -> int:
    """How many of ``size`` tokens (two or more) the tail split holds out: at least one, and
    one fewer than all."""
    return min(max(1, round(size * validation_fraction)), size - 1)


def split_by_file(
    names: list[str], validation_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """Partition file names into (train, validation), keeping the input order within each.

    A name goes to validation when ``crc32(name, seed) % 1000 < validation_fraction * 1000``:
    stable across runs, machines and additions of other files. With two or more names both
    parts are non-empty: the lowest-hashed name is forced into validation, the highest into train.
    """
    assert len(names) >= 2, "by-file split needs at least two files"
    buckets = {name: zlib.crc32(name.encode(), int(seed)) % 1000 for name in names}
    threshold = validation_fraction * 1000
    validation = {name for name in names if buckets[name] < threshold}
    ranked = sorted(names, key=lambda name: (buckets[name], name))
    if not validation:
        validation = {ranked[0]}
    if len(validation) == len(names):
        validation.discard(ranked[-1])
    return [n for n in names if n not in validation], [n for n in names if n in validation]


def builtin_files() -> tuple[Path, list[str]]:
    """The stdlib directory and the relative posix paths of the files the built-in corpus uses."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = []
    total = 0
    for name in walk_sorted(root, skip_dirs=_BUILTIN_SKIP_DIRS):
        if not name.endswith(".py"):
            continue
        size = (root / name).stat().st_size
        if size == 0:
            continue
        if total + size > BUILTIN_MAX_BYTES:
            break
        names.append(name)
        total += size
    return root, names


@functools.cache
def _builtin_corpus(validation_fraction: float, seed: int) -> Corpus:
    root, names = builtin_files()
    if len(names) < 2:
        raise ValueError(
            f"the built-in corpus found {len(names)} .py files under {str(root)!r}; "
            "this Python installation lacks its standard library source, pass a corpus path instead"
        )
    train, validation = _split_files(root, names, validation_fraction, seed)
    source = f"built-in: Python standard library source ({root}), {len(names)} files"
    return Corpus(train, validation, BYTE_VOCAB_SIZE, source)


def _directory_corpus(root: Path, fraction: float, seed: int, text_field: str) -> Corpus:
    inputs = list_inputs(root, walk_sorted(root))
    if not inputs:
        raise ValueError(
            f"corpus directory {str(root)!r} holds no non-empty, non-hidden files; "
            "add data or pick another path"
        )
    where = f"directory {str(root)!r}"
    if len(inputs) == 1 and inputs[0].kind == "text" and inputs[0].compression is None:
        tokens = _bytes_to_tokens(_read_nonempty(inputs[0].path))
        train, validation = tail_split(tokens, fraction)
        return Corpus(train, validation, BYTE_VOCAB_SIZE, f"{where}, 1 file")
    return _documents_corpus(inputs, fraction, seed, text_field, where)


def _documents_corpus(inputs, fraction: float, seed: int, text_field: str, where: str) -> Corpus:
    """A byte corpus of documents, split by document (a single compressed text file: its
    decompressed bytes, split at the tail)."""
    if len(inputs) == 1 and inputs[0].kind == "text":
        train, validation = tail_split(_bytes_to_tokens(read_bytes(inputs[0])), fraction)
        return Corpus(train, validation, BYTE_VOCAB_SIZE, f"{where}, 1 file")
    train, validation = split_documents(inputs, text_field, fraction, seed)
    if not train.size or not validation.size:
        raise ValueError(
            f"corpus {where} gives an empty {'train' if not train.size else 'validation'} split "
            f"({len(inputs)} file(s)); it needs at least two non-empty documents"
        )
    return Corpus(train, validation, BYTE_VOCAB_SIZE, f"{where}, {len(inputs)} file(s)")


def _split_files(
    root: Path, names: list[str], validation_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split files by name; concatenate each split's bytes (no separator) into read-only tokens."""
    train_names, validation_names = split_by_file(names, validation_fraction, seed)
    train = _bytes_to_tokens(b"".join((root / n).read_bytes() for n in train_names))
    validation = _bytes_to_tokens(b"".join((root / n).read_bytes() for n in validation_names))
    return train, validation


def _bin_corpus(
    path: Path, validation_fraction: float, token_dtype: str, vocab_size: int | None
) -> Corpus:
    tokens = _memmap_tokens(path, token_dtype)
    if vocab_size is None:
        vocab_size = _recorded_vocab_size(path, token_dtype, tokens.size)
    if vocab_size is None:
        vocab_size = int(tokens.max()) + 1
    if not isinstance(vocab_size, int) or not 0 < vocab_size <= np.iinfo(np.int32).max:
        raise ValueError(f"vocab_size must be an int in [1, 2**31 - 1], got {vocab_size!r}")
    train, validation = tail_split(tokens, validation_fraction)
    return Corpus(
        train,
        validation,
        vocab_size,
        f"token file {str(path)!r}, {tokens.size} {token_dtype} tokens",
    )


def _memmap_tokens(path: Path, token_dtype: str) -> np.ndarray:
    """A non-empty ``.bin`` file of ``token_dtype`` tokens, memory-mapped read-only."""
    _check_token_dtype(token_dtype)
    itemsize = np.dtype(token_dtype).itemsize
    size = path.stat().st_size
    if size == 0:
        raise ValueError(
            f"token file {str(path)!r} is empty; write tokens into it or pick another path"
        )
    if size % itemsize:
        raise ValueError(
            f"token file {str(path)!r} has {size} bytes, not a multiple of the {itemsize}-byte "
            f"{token_dtype} tokens; pass the token_dtype it was written with or rewrite it"
        )
    return np.memmap(path, dtype=token_dtype, mode="r")


def _tokenized_corpus(root: Path, vocab_size: int | None) -> Corpus:
    """The splits ``theseus tokenize`` wrote, memory-mapped, with the record's vocabulary."""
    if vocab_size is not None:
        raise ValueError(
            f"{str(root)!r} is a tokenized folder whose {TOKENIZED_RECORD} fixes the vocabulary; "
            "drop vocab_size"
        )
    manifest = read_manifest(root)
    dtype, record_vocab = manifest.token_dtype, manifest.vocab_size
    train, validation = (open_split(root, manifest, name) for name in SPLITS)
    tokenizer = root / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ValueError(f"{str(root)!r} lacks {TOKENIZER_FILE}; tokenize the corpus again")
    source = (
        f"tokenized folder {str(root)!r}, {train.size} + {validation.size} {dtype} tokens, "
        f"vocab {record_vocab}"
    )
    return Corpus(train, validation, record_vocab, source, tokenizer)


def _recorded_vocab_size(path: Path, token_dtype: str, num_tokens: int) -> int | None:
    """The vocabulary size that :func:`write_tokens` recorded beside ``path``, if any."""
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        return None
    try:
        info = json.loads(sidecar.read_text())
        recorded = (info["vocab_size"], info["token_dtype"], info["num_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"cannot read {str(sidecar)!r} ({error}); delete it (the vocabulary size is then "
            "found by scanning the file) or write the tokens again with write_tokens"
        ) from None
    if recorded[1:] != (token_dtype, num_tokens):
        raise ValueError(
            f"{str(sidecar)!r} describes {recorded[2]} {recorded[1]} tokens, but {str(path)!r} "
            f"read as {token_dtype} holds {num_tokens}: pass data.token_dtype={recorded[1]} if "
            "that is how it was written, or write the file and its sidecar again together"
        )
    return recorded[0]


def _read_nonempty(path: Path) -> bytes:
    data = path.read_bytes()
    if not data:
        raise ValueError(f"corpus file {str(path)!r} is empty; add data or pick another path")
    return data


def _bytes_to_tokens(data: bytes) -> np.ndarray:
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)  # (num_bytes,)
    tokens.setflags(write=False)
    return tokens


def _check_fraction(validation_fraction: float) -> None:
    if not isinstance(validation_fraction, (int, float)) or not 0 < validation_fraction < 1:
        raise ValueError(
            f"validation_fraction must be strictly between 0 and 1, got {validation_fraction!r}"
        )


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")


def _check_token_dtype(dtype: str) -> None:
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype must be one of {TOKEN_DTYPES}, got {dtype!r}")


def _check_byte_options(path: Path | None, vocab_size: int | None) -> None:
    if vocab_size is not None:
        where = "the built-in corpus" if path is None else repr(str(path))
        raise ValueError(
            f"vocab_size applies only to .bin token files, but {where} is a byte corpus "
            f"(vocab {BYTE_VOCAB_SIZE}); drop vocab_size"
        )
