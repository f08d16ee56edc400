"""Loading a corpus: which source a path names (the built-in corpus, a tokenized folder, a folder
of documents, a ``.bin`` token file, a text or document file), and the byte corpora.

Every corpus is a :class:`~theseus.data.corpus.Corpus`. Byte corpora (the built-in one, text
files, directories) have ``vocab_size == 256``; ``.bin`` files (:mod:`theseus.data.binfile`) and
tokenized folders are memory-mapped, so a training process only reads the pages its examples
touch. The splits are :mod:`theseus.data.split`'s.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import numpy as np

from theseus.config import check_int
from theseus.data.binfile import bin_corpus
from theseus.data.corpus import BYTE_VOCAB_SIZE, Corpus, bytes_to_tokens
from theseus.data.documents import split_documents
from theseus.data.packing import MaskedExamples
from theseus.data.preference import is_preference, pairs_of
from theseus.data.readers import kind_of, list_inputs, read_bytes, walk_sorted
from theseus.data.shards import (
    SHARD_PATTERN,
    SPLITS,
    TOKENIZED_RECORD,
    TOKENIZER_FILE,
    Manifest,
    ShardedTokens,
    example_lengths,
    is_incomplete,
    open_masks,
    open_split,
    read_manifest,
)
from theseus.data.split import split_by_file, tail_split

# The built-in corpus takes stdlib files in sorted order until about this many bytes.
BUILTIN_MAX_BYTES = 8 * 2**20
_BUILTIN_SKIP_DIRS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


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
      not finished is refused. A chat folder's examples (tokens, loss mask and lengths) come
      with it (``Corpus.examples``), packed into rows by the sampler; a preference folder's
      also as pairs (``Corpus.pairs``, :mod:`theseus.data.preference`).
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
        return bin_corpus(path, validation_fraction, token_dtype, vocab_size)
    _check_byte_options(path, vocab_size)
    inputs = list_inputs(path.parent, [path.name])
    if inputs and (kind_of(path) != "text" or inputs[0].compression is not None):
        return _documents_corpus(inputs, validation_fraction, seed, text_field, repr(str(path)))
    tokens = bytes_to_tokens(_read_nonempty(path))
    train, validation = tail_split(tokens, validation_fraction)
    return Corpus(
        train, validation, BYTE_VOCAB_SIZE, f"text file {str(path)!r}, {tokens.size} bytes"
    )


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
        tokens = bytes_to_tokens(_read_nonempty(inputs[0].path))
        train, validation = tail_split(tokens, fraction)
        return Corpus(train, validation, BYTE_VOCAB_SIZE, f"{where}, 1 file")
    return _documents_corpus(inputs, fraction, seed, text_field, where)


def _documents_corpus(inputs, fraction: float, seed: int, text_field: str, where: str) -> Corpus:
    """A byte corpus of documents, split by document (a single compressed text file: its
    decompressed bytes, split at the tail)."""
    if len(inputs) == 1 and inputs[0].kind == "text":
        train, validation = tail_split(bytes_to_tokens(read_bytes(inputs[0])), fraction)
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
    train = bytes_to_tokens(b"".join((root / n).read_bytes() for n in train_names))
    validation = bytes_to_tokens(b"".join((root / n).read_bytes() for n in validation_names))
    return train, validation


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
    eos_id = manifest.data.get("eos_id")
    examples = pairs = None
    if manifest.data.get("loss_mask"):
        kind = "preference" if is_preference(manifest) else "chat"
        source = source.replace("tokenized folder", f"tokenized {kind} folder", 1)
        examples = (
            MaskedExamples(train, *_masks_and_lengths(root, manifest, "train")),
            MaskedExamples(validation, *_masks_and_lengths(root, manifest, "validation")),
        )
        if is_preference(manifest):
            pairs = (pairs_of(examples[0], source), pairs_of(examples[1], source))
    return Corpus(train, validation, record_vocab, source, tokenizer, eos_id, examples, pairs)


def _read_nonempty(path: Path) -> bytes:
    data = path.read_bytes()
    if not data:
        raise ValueError(f"corpus file {str(path)!r} is empty; add data or pick another path")
    return data


def _check_fraction(validation_fraction: float) -> None:
    if not isinstance(validation_fraction, (int, float)) or not 0 < validation_fraction < 1:
        raise ValueError(
            f"validation_fraction must be strictly between 0 and 1, got {validation_fraction!r}"
        )


def _check_seed(seed: int) -> None:
    check_int("seed", seed, minimum=0, maximum=2**32 - 1)


def _check_byte_options(path: Path | None, vocab_size: int | None) -> None:
    if vocab_size is not None:
        where = "the built-in corpus" if path is None else repr(str(path))
        raise ValueError(
            f"vocab_size applies only to .bin token files, but {where} is a byte corpus "
            f"(vocab {BYTE_VOCAB_SIZE}); drop vocab_size"
        )


def _masks_and_lengths(
    root: Path, manifest: Manifest, split: str
) -> tuple[np.ndarray | ShardedTokens, np.ndarray]:
    """A masked split's loss masks and example lengths."""
    return open_masks(root, manifest, split), example_lengths(root, manifest, split)
