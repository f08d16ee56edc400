"""How many bytes of array data a save or restore may keep in flight on the host at once.

Orbax writes every shard of a state at once by default: each write holds its encoded (zstd)
copy until it reaches the file, and each read holds the compressed bytes and the decoded shard
until the shard is placed. For a whole state that is a second copy of it in host memory. Orbax's
in-flight byte limits (``save_concurrent_bytes`` / ``restore_concurrent_bytes``) bound this, but a
single request larger than the limit is an error, so the limit of each call is the configured
budget or, if one request is larger, just above that request: a shard is never split, and the
host holds at most about one budget (or one shard) of staging at a time.

A write request is one shard held by this process (orbax writes each distinct shard once); a
read request is one target shard widened to the stored chunk grid (the shard shape the step was
saved with), which is larger than the target shard when the layout changed since the save.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from theseus.sharding.layout import path_str

#: The default in-flight budget per process: a few shards of a billion-parameter model under
#: FSDP at once, far below a copy of the state.
HOST_BUDGET_BYTES = 256 * 2**20


def limit(budget: int, requests: Iterable[int]) -> int:
    """The in-flight byte limit for one call: ``budget``, or just above the largest request
    (orbax refuses a request at or above its limit)."""
    return max([budget, *(request + 1 for request in requests)])


def _shard_shape(leaf: Any) -> tuple[int, ...]:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return tuple(np.shape(leaf))
    return tuple(sharding.shard_shape(tuple(leaf.shape)))


def write_requests(state: Any) -> list[int]:
    """Bytes of one shard of each array leaf of ``state`` (the size of its write requests)."""
    return [
        math.prod(_shard_shape(leaf)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(state)
        if hasattr(leaf, "dtype") and hasattr(leaf, "shape")
    ]


def _chunk_span(start: int, stop: int, chunk: int) -> int:
    """The length of ``[start, stop)`` widened to multiples of ``chunk`` (as orbax estimates)."""
    return -(-stop // chunk) * chunk - start // chunk * chunk


def read_request(shape: Sequence[int], itemsize: int, chunk: Sequence[int], index: Any) -> int:
    """Bytes orbax reserves to read the region ``index`` (a tuple of slices) of an array of
    ``shape`` stored in chunks of ``chunk``."""
    size = itemsize
    for dim, (length, part) in enumerate(zip(shape, index, strict=True)):
        start, stop, _ = part.indices(length)
        size *= _chunk_span(start, stop, max(1, chunk[dim]))
    return size


def read_requests(saved: Any, target: Any) -> list[int]:
    """The read request sizes of restoring ``saved`` (orbax's metadata tree of the step) into
    ``target`` (``jax.ShapeDtypeStruct`` leaves with shardings; paths matched by name). An array
    whose metadata does not give its chunk shape counts as one chunk (its whole size)."""
    stored = {path_str(path): meta for path, meta in jax.tree_util.tree_flatten_with_path(saved)[0]}
    requests = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        shape = tuple(leaf.shape)
        meta = stored.get(path_str(path))
        chunk = getattr(getattr(meta, "storage", None), "chunk_shape", None)
        if chunk is None or len(chunk) != len(shape):
            chunk = shape
        itemsize = np.dtype(getattr(meta, "dtype", None) or leaf.dtype).itemsize
        sharding = getattr(leaf, "sharding", None)
        indices = (
            sharding.devices_indices_map(shape).values()
            if sharding is not None
            else [tuple(slice(None) for _ in shape)]
        )
        requests += [read_request(shape, itemsize, chunk, index) for index in indices]
    return requests
