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

BYTE_VOCAB_SIZE = 256
TOKEN_DTYPES = ("uint16", "uint32")

# A folder written by `theseus tokenize` (theseus.data.bpe): its record, tokenizer and splits.
TOKENIZED_RECORD = "tokens.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZED_SPLITS = ("train.bin", "validation.bin")

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
) -> Corpus:
    """Load a corpus and split it into train and validation.

    ``path`` selects the source:

    - ``None``: the Python standard library's ``.py`` files (no download needed), split by file.
    - a directory written by ``theseus tokenize`` (it holds ``tokens.json``): its
      ``train.bin`` and ``validation.bin``, split when it was tokenized, with its vocabulary size
      and ``tokenizer.json``. Either of those two ``.bin`` files names the whole folder.
    - any other directory: the bytes of every non-hidden regular file below it, split by file
      (a tail split when it holds a single non-empty file).
    - a file ending in ``.bin``: pre-tokenized ``token_dtype`` tokens, memory-mapped,
      with the last ``validation_fraction`` as validation. ``vocab_size`` defaults to the one
      recorded beside the file by :func:`write_tokens` (``FILE.bin.json``), else to max token + 1
      (one pass over the whole file, on every process).
    - any other file: its bytes, with the last ``validation_fraction`` as validation.

    ``seed`` salts which files go to validation in a by-file split; tail splits ignore it.
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
            f"corpus path {str(path)!r} does not exist; pass an existing text file, directory "
            "or .bin token file, or no path for the built-in corpus"
        )
    if path.is_dir() and (path / TOKENIZED_RECORD).is_file():
        return _tokenized_corpus(path, vocab_size)
    if path.name in TOKENIZED_SPLITS and (path.parent / TOKENIZED_RECORD).is_file():
        return _tokenized_corpus(path.parent, vocab_size)  # either .bin names its folder
    if path.is_dir():
        _check_byte_options(path, vocab_size)
        return _directory_corpus(path, validation_fraction, seed)
    if path.suffix == ".bin":
        return _bin_corpus(path, validation_fraction, token_dtype, vocab_size)
    _check_byte_options(path, vocab_size)
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
    n = tokens.size
    num_validation = min(max(1, round(n * validation_fraction)), n - 1)
    return tokens[: n - num_validation], tokens[n - num_validation :]


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
    for name in _walk_sorted(root, skip_dirs=_BUILTIN_SKIP_DIRS):
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


def _directory_corpus(root: Path, validation_fraction: float, seed: int) -> Corpus:
    names = [
        name
        for name in _walk_sorted(root, skip_dirs=frozenset())
        if (root / name).stat().st_size > 0
    ]
    if not names:
        raise ValueError(
            f"corpus directory {str(root)!r} holds no non-empty, non-hidden files; "
            "add data or pick another path"
        )
    if len(names) == 1:
        tokens = _bytes_to_tokens(_read_nonempty(root / names[0]))
        train, validation = tail_split(tokens, validation_fraction)
        return Corpus(train, validation, BYTE_VOCAB_SIZE, f"directory {str(root)!r}, 1 file")
    train, validation = _split_files(root, names, validation_fraction, seed)
    return Corpus(
        train, validation, BYTE_VOCAB_SIZE, f"directory {str(root)!r}, {len(names)} files"
    )


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
    try:
        record = json.loads((root / TOKENIZED_RECORD).read_text())
        dtype, record_vocab = record["token_dtype"], int(record["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"cannot read {root / TOKENIZED_RECORD}: {error}; tokenize the corpus again"
        ) from None
    train, validation = (_memmap_tokens(root / name, dtype) for name in TOKENIZED_SPLITS)
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


def _walk_sorted(root: Path, *, skip_dirs: frozenset[str]) -> list[str]:
    """Sorted relative posix paths of the non-hidden regular files below ``root``."""
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
        for filename in sorted(filenames):
            full = Path(dirpath, filename)
            if not filename.startswith(".") and full.is_file():
                names.append(full.relative_to(root).as_posix())
    return sorted(names)


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
