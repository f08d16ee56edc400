"""The sharded token format of ``theseus tokenize``: ``train-NNNNN.bin`` and
``validation-NNNNN.bin`` shards of raw tokens, and the ``tokens.json`` manifest, written last.

A tokenized chat corpus also holds, beside each token shard, its loss mask
(``train-NNNNN.mask``, one ``uint8`` per token: 1 where the token trains) and its conversations'
lengths (``train-NNNNN.docs``, one ``uint32`` token count per conversation, in order: where
examples begin), both named in the shard's manifest entry. A preference corpus
(``"kind": "preference"``, :mod:`theseus.data.preference`) is such a masked corpus whose examples
come in pairs (chosen, then rejected, one document per pair, never split across shards) and whose
mask is 1 on the completion tokens.

A shard is written as a hidden ``.NAME.partial`` file and renamed when complete; the progress
record ``.tokenize-progress.json`` lists the complete shards and where in the corpus each split
goes on, so an interrupted run resumes from them. A folder trains only once its manifest
exists; :func:`open_split` memory-maps a split's shards as one index space.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZED_RECORD = "tokens.json"  # the manifest
TOKENIZER_FILE = "tokenizer.json"
PROGRESS_FILE = ".tokenize-progress.json"
SPLITS = ("train", "validation")
FORMAT = "theseus-token-shards-1"
SHARD_PATTERN = re.compile(r"(train|validation)-\d{5}\.bin")
MASK_PATTERN = re.compile(r"(train|validation)-\d{5}\.(mask|docs)")
MASK_DTYPE = "uint8"
DOCS_DTYPE = "uint32"


def shard_name(split: str, index: int, suffix: str = "bin") -> str:
    return f"{split}-{index:05d}.{suffix}"


def is_partial(name: str) -> bool:
    """A shard or mask that a run began and did not finish (``.NAME.partial``)."""
    return name.startswith(".") and name.endswith(
        (".bin.partial", ".mask.partial", ".docs.partial")
    )


def is_incomplete(folder: Path) -> bool:
    """A folder that ``tokenize`` began and did not finish (it must not train)."""
    return not (folder / TOKENIZED_RECORD).exists() and (
        (folder / PROGRESS_FILE).exists()
        or any(SHARD_PATTERN.fullmatch(p.name) for p in folder.iterdir())
    )


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary file and rename it, so a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temporary, path)


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {what} {path}: {error}; tokenize the corpus again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} is not a JSON object; tokenize the corpus again")
    return data


class ShardedTokens:
    """The shards of one split as one read-only 1-D token sequence (no copy): integer-array and
    slice indexing map each global index to its shard through the cumulative sizes."""

    ndim = 1

    def __init__(self, shards: Sequence[np.ndarray]):
        assert shards and all(s.ndim == 1 and s.dtype == shards[0].dtype for s in shards)
        self.shards = shards
        self.starts = np.cumsum([0] + [s.size for s in shards])  # (num_shards + 1,)
        self.size = int(self.starts[-1])
        self.shape = (self.size,)
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.size)
            assert step == 1, "sharded tokens are sliced contiguously"
            index = np.arange(start, stop, dtype=np.int64)
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.size):
            raise IndexError(f"token index out of range [0, {self.size})")
        shard = np.searchsorted(self.starts, index, side="right") - 1  # (index.shape)
        out = np.empty(index.shape, self.dtype)
        for number in np.unique(shard):
            where = shard == number
            out[where] = self.shards[number][index[where] - self.starts[number]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate(self.shards)
        return whole if dtype is None else whole.astype(dtype)


@dataclass(frozen=True)
class Manifest:
    """What ``tokens.json`` says: the vocabulary, dtype, end-of-text token, and per split its
    shards (name and token count), documents, tokens and UTF-8 bytes."""

    data: dict

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab_size"])

    @property
    def token_dtype(self) -> str:
        return self.data["token_dtype"]

    def split(self, name: str) -> dict:
        return self.data["splits"][name]


def read_manifest(folder: Path) -> Manifest:
    """The manifest of a tokenized folder, checked for the fields training needs."""
    path = folder / TOKENIZED_RECORD
    data = read_json(path, "manifest")
    try:
        if data["format"] != FORMAT:
            raise ValueError(f"format {data['format']!r}, expected {FORMAT!r}")
        int(data["vocab_size"])
        np.dtype(data["token_dtype"])
        for split in SPLITS:
            for shard in data["splits"][split]["shards"]:
                shard["name"], int(shard["tokens"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{path} is not a manifest of this theseus's token shards ({error}); tokenize the "
            "corpus again with this version"
        ) from None
    return Manifest(data)


def open_split(folder: Path, manifest: Manifest, split: str) -> np.ndarray | ShardedTokens:
    """A split's shards memory-mapped as one token sequence (a shard's size is checked against
    the manifest; nothing else is read)."""
    return _open_shards(folder, manifest, split, "name", np.dtype(manifest.token_dtype))


def open_masks(folder: Path, manifest: Manifest, split: str) -> np.ndarray | ShardedTokens:
    """A masked corpus's loss mask of a split (1 where a token trains), memory-mapped as one
    sequence aligned with :func:`open_split`'s tokens."""
    if not manifest.data.get("loss_mask"):
        raise ValueError(f"{folder} holds no loss mask; tokenize a chat corpus to make one")
    return _open_shards(folder, manifest, split, "mask", np.dtype(MASK_DTYPE))


def example_lengths(folder: Path, manifest: Manifest, split: str) -> np.ndarray:
    """A chat corpus's conversation lengths in tokens, in order over a split's shards (their
    running sum is where each example begins in :func:`open_split`'s tokens)."""
    if not manifest.data.get("loss_mask"):
        raise ValueError(f"{folder} holds no conversation lengths; tokenize a chat corpus")
    parts = [
        np.fromfile(folder / shard["docs"], dtype=DOCS_DTYPE)
        for shard in manifest.split(split)["shards"]
    ]
    return np.concatenate(parts).astype(np.int64)  # (conversations,)


def _open_shards(folder: Path, manifest: Manifest, split: str, key: str, dtype: np.dtype):
    shards = []
    for shard in manifest.split(split)["shards"]:
        path = folder / shard[key]
        expected = int(shard["tokens"]) * dtype.itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            raise ValueError(
                f"shard {path} should hold {shard['tokens']} {dtype} values ({expected} bytes) "
                f"but {'is missing' if actual is None else f'has {actual} bytes'}; tokenize "
                "the corpus again"
            )
        if expected:
            shards.append(np.memmap(path, dtype=dtype, mode="r"))
    if not shards:
        raise ValueError(
            f"the {split} split of {folder} holds no tokens; tokenize a larger corpus or change "
            "the validation fraction"
        )
    return shards[0] if len(shards) == 1 else ShardedTokens(shards)


class ShardWriter:
    """Appends one split's tokens (and, for a chat corpus, their loss mask) to its current shard
    (hidden partial files) and closes the shard, by renaming its files, once it holds
    ``shard_tokens`` or more at a piece boundary. ``dtypes`` maps each file's suffix to its
    dtype: ``{"bin": token dtype}``, plus ``"mask": MASK_DTYPE`` and ``"docs": DOCS_DTYPE``
    for a masked corpus (whose pieces are its examples: one per chat document, two per
    preference pair)."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, dtypes: dict, done: list):
        assert next(iter(dtypes)) == "bin" and set(dtypes) <= {"bin", "mask", "docs"}
        self.folder = folder
        self.split = split
        self.shard_tokens = shard_tokens
        self.dtypes = {suffix: np.dtype(dtype) for suffix, dtype in dtypes.items()}
        self.shards = list(done)  # complete shards: {"name", "tokens", "documents", "bytes"...}
        self._files: dict = {}
        self._tokens = self._documents = self._bytes = self._trained = 0

    def _partial(self, suffix: str) -> Path:
        return self.folder / f".{shard_name(self.split, len(self.shards), suffix)}.partial"

    def write_pieces(
        self,
        arrays: dict[str, np.ndarray],
        counts: list[int],
        sizes: list[int],
        lasts: list[bool],
        on_close: Callable[[int], None],
    ) -> None:
        """Append consecutive pieces (``arrays`` holds, per suffix, their tokens or mask values
        concatenated, or for ``"docs"`` one value per piece; piece ``i`` has ``counts[i]``
        tokens, ``sizes[i]`` bytes of text and ends its document when ``lasts[i]``); a shard
        closes after the first piece that brings it to ``shard_tokens`` or more (for a masked
        corpus, the first such piece that ends a document: a preference pair's two examples
        stay in one shard), and ``on_close(i)`` is called then, while ``shards`` ends with
        that shard."""
        whole = "docs" in self.dtypes  # a masked corpus's shards close at document ends only
        start = 0  # first token of this shard's part of the arrays
        offset = 0
        first = 0  # first piece of this shard's part
        for index, (count, size, last) in enumerate(zip(counts, sizes, lasts, strict=True)):
            offset += count
            self._tokens += count
            self._bytes += size
            self._documents += int(last)
            if self._tokens >= self.shard_tokens and (last or not whole):
                self._append(arrays, (start, offset), (first, index + 1))
                self.close_shard()
                on_close(index)
                start, first = offset, index + 1
        if start < offset:
            self._append(arrays, (start, offset), (first, len(counts)))

    def _append(self, arrays: dict[str, np.ndarray], tokens: tuple, pieces: tuple) -> None:
        """Append tokens ``[start, stop)`` (and pieces ``[first, last)`` for ``"docs"``)."""
        for suffix, dtype in self.dtypes.items():
            start, stop = pieces if suffix == "docs" else tokens
            if suffix not in self._files:
                self._files[suffix] = open(self._partial(suffix), "wb")  # noqa: SIM115 - closed in close_shard
            values = np.ascontiguousarray(arrays[suffix][start:stop], dtype=dtype)
            self._files[suffix].write(values.tobytes())
            if suffix == "mask":
                self._trained += int(np.count_nonzero(values))

    def close_shard(self) -> None:
        """Finish the current shard (if it holds anything): flush, sync, rename (the
        tokens last, so a shard whose tokens exist has its mask and lengths)."""
        if not self._files:
            return
        entry: dict[str, Any] = {}
        for suffix in reversed(self.dtypes):
            stream = self._files.pop(suffix)
            stream.flush()
            os.fsync(stream.fileno())
            stream.close()
            name = shard_name(self.split, len(self.shards), suffix)
            os.replace(self._partial(suffix), self.folder / name)
            entry["name" if suffix == "bin" else suffix] = name
        entry.update(tokens=self._tokens, documents=self._documents, bytes=self._bytes)
        if "mask" in self.dtypes:
            entry["trained_tokens"] = self._trained
        self.shards.append(entry)
        self._tokens = self._documents = self._bytes = self._trained = 0

    def abandon(self) -> None:
        """Close the partial shard without keeping it."""
        for suffix, stream in self._files.items():
            stream.close()
            self._partial(suffix).unlink(missing_ok=True)
        self._files = {}

    def summary(self) -> dict:
        """The split's entry of the manifest."""
        kept = ("name", "tokens", "mask", "docs", "trained_tokens")
        totals = ("tokens", "documents", "bytes", "trained_tokens")
        return {
            "shards": [{key: s[key] for key in kept if key in s} for s in self.shards],
            **{
                key: sum(s[key] for s in self.shards)
                for key in totals
                if key != "trained_tokens" or "mask" in self.dtypes
            },
        }
