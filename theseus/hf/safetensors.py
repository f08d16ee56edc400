"""The safetensors format, read memory-mapped slice by slice and written one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header (per tensor: ``dtype``, ``shape``,
``data_offsets`` into the data that follows; ``__metadata__`` optional) and the raw little-endian
data (https://github.com/huggingface/safetensors). The ``safetensors`` package's numpy API cannot
read bfloat16, the dtype most checkpoints are published in; numpy with ``ml_dtypes`` can, so this
module reads the format itself: a tensor is a ``numpy.memmap`` of its bytes, and a caller reading
one slice of it touches only the pages of that slice.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ALIGN = 8


class SafetensorsError(ValueError):
    """A safetensors file is truncated, damaged, or holds an unsupported dtype."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: its file, dtype, shape and absolute byte offset."""

    file: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def array(self) -> np.ndarray:
        """The tensor as a read-only memory map (nothing is read until it is indexed)."""
        if not self.shape or 0 in self.shape:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.file, self.dtype, "r", self.offset, self.shape)


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors of one file, checked against its size (a truncated file is named)."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{file} is truncated: {size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise SafetensorsError(
                f"{file} is truncated: its header says {length} bytes but the file has {size}"
            )
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise SafetensorsError(f"{file} is not a safetensors file: {error}") from None
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(
                f"{file}: tensor {name} has dtype {entry['dtype']}; supported: {sorted(DTYPES)}"
            )
        begin, end = entry["data_offsets"]
        info = TensorInfo(file, name, DTYPES[entry["dtype"]], tuple(entry["shape"]), start + begin)
        if end - begin != info.nbytes or start + end > size:
            raise SafetensorsError(
                f"{file} is truncated or damaged: tensor {name} {info.shape} needs bytes "
                f"{start + begin}..{start + end} but the file has {size}"
            )
        tensors[name] = info
    return tensors


def checkpoint_tensors(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of a Hugging Face checkpoint folder: ``model.safetensors``, or the shards
    listed by ``model.safetensors.index.json``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise SafetensorsError(f"{index} lists shard(s) that do not exist: {missing[:3]}")
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise SafetensorsError(
            f"{directory} holds no model.safetensors or model.safetensors.index.json; "
            "theseus reads safetensors checkpoints (convert .bin/.pt weights with transformers)"
        )
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        tensors.update(read_header(directory / file))
    return tensors


def _header_bytes(entries: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> bytes:
    header: dict[str, dict[str, Any]] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in entries.items():
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_file(
    file: Path,
    entries: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, Iterator[np.ndarray]]],
) -> None:
    """Write the tensors named in ``entries`` (name → dtype, shape). ``tensors`` yields, in the
    same order, each name with its data as blocks of rows (consecutive slices of the first
    dimension): one block is in memory at a time."""
    with file.open("wb") as handle:
        handle.write(_header_bytes(entries))
        for (name, (dtype, shape)), (got_name, blocks) in zip(
            entries.items(), tensors, strict=True
        ):
            assert name == got_name, (name, got_name)
            written = 0
            for block in blocks:
                assert block.dtype == dtype and block.shape[1:] == shape[1:], name
                handle.write(np.ascontiguousarray(block).view(np.uint8).data)
                written += block.nbytes
            assert written == math.prod(shape) * np.dtype(dtype).itemsize, name
