"""``.bin`` token files: raw 1-D token arrays, memory-mapped, with a JSON sidecar
(``FILE.bin.json``) that records their vocabulary size, dtype and length."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from theseus.config import is_int
from theseus.data.corpus import Corpus
from theseus.data.split import tail_split

TOKEN_DTYPES = ("uint16", "uint32")


def sidecar_path(path: str | os.PathLike) -> Path:
    """The JSON file beside a ``.bin`` token file that records its vocabulary size and length."""
    return Path(f"{path}.json")


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
    if not is_int(vocab_size) or vocab_size <= int(tokens.max()):
        raise ValueError(
            f"vocab_size={vocab_size!r} must be an int above the largest token {tokens.max()}"
        )
    tokens.astype(dtype).tofile(path)
    info = {"vocab_size": vocab_size, "token_dtype": dtype, "num_tokens": int(tokens.size)}
    sidecar_path(path).write_text(json.dumps(info) + "\n")


def bin_corpus(
    path: Path, validation_fraction: float, token_dtype: str, vocab_size: int | None
) -> Corpus:
    """The tokens of ``path``, with the last ``validation_fraction`` as validation."""
    tokens = _memmap_tokens(path, token_dtype)
    if vocab_size is None:
        vocab_size = _recorded_vocab_size(path, token_dtype, tokens.size)
    if vocab_size is None:
        vocab_size = int(tokens.max()) + 1
    if not is_int(vocab_size) or not 0 < vocab_size <= np.iinfo(np.int32).max:
        raise ValueError(f"vocab_size must be an int in [1, 2**31 - 1], got {vocab_size!r}")
    train, validation = tail_split(tokens, validation_fraction)
    return Corpus(
        train,
        validation,
        int(vocab_size),
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


def _check_token_dtype(dtype: str) -> None:
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype must be one of {TOKEN_DTYPES}, got {dtype!r}")
