"""Fingerprints of a checkpoint's arrays: exact uint32 hashes of every element's bits and position
that do not depend on the layout or device count the arrays are held in, so a restore under
another policy checks the same numbers that were saved.

Element hashes are summed modulo 2**32, which is associative and commutative, so the value does not
depend on the layout or device count an array is held in, nor on the blocks it is summed in;
changing any one element always changes it (the element hash is a bijection of its bits, given its
position). One formula (:func:`_block_sum`), computed where the arrays are. On GPUs and TPUs each
array is hashed whole in one jitted program, where XLA fuses the element hashes into one reduction.
On CPU devices the shards are host memory: each process hashes the shards it holds first (replica
0) with NumPy, in blocks of rows (:data:`BLOCK_ELEMENTS` elements at a time, so no second copy of
the state is made), and the processes add their sums. No program is compiled for them: a jitted
fingerprint of a state compiled for about a second on CPU, at every save and restore of a new
state's shape.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from theseus.sharding.layout import path_str

#: Elements of one shard hashed at once on the host (a uint32 block of 1 MiB).
BLOCK_ELEMENTS = 2**18


def _mix(h: Any) -> Any:
    """A bijection of uint32 (murmur3's finaliser)."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (in elements), modulo 2**32."""
    return tuple(math.prod(shape[dim + 1 :]) % 2**32 for dim in range(len(shape)))


def _block_sum(
    bits: Any, offsets: tuple[int, ...], strides: tuple[int, ...], xp: ModuleType
) -> Any:
    """Sum (mod 2**32) of the element hashes of the uint32 block ``bits`` (``xp``: NumPy or
    jax.numpy), whose first element sits at the global coordinates ``offsets`` of an array with
    row-major ``strides`` (of its bits)."""
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps (NumPy warns on scalars)
        index = np.uint32(0)
        for dim, size in enumerate(bits.shape):
            coord = xp.arange(size, dtype=np.uint32).reshape(
                [size if d == dim else 1 for d in range(bits.ndim)]
            )  # broadcast against the other dims
            start = offsets[dim] if dim < len(offsets) else 0
            index = index + (coord + np.uint32(start % 2**32)) * np.uint32(strides[dim])
        hashed = _mix(bits ^ _mix(index * np.uint32(0x9E3779B9) + np.uint32(0x7F4A7C15)))
        return xp.sum(hashed, dtype=np.uint32)


def _as_array(x: Any) -> Any:
    """A typed PRNG key as its key data (the bits a checkpoint holds)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def _strides_of(x: Any) -> tuple[int, ...]:
    """Strides of ``x``'s bits: 8-byte elements are two words, a trailing dim of 2."""
    extra = (2,) if np.dtype(x.dtype).itemsize == 8 else ()
    return _strides((*x.shape, *extra))


def _device_bits(x: jax.Array) -> jax.Array:
    """Each element's bits as uint32 (8-byte elements as two words: a trailing dim of 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    itemsize = np.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _host_bits(x: np.ndarray) -> np.ndarray:
    """:func:`_device_bits` of a host array (little-endian words, as XLA's bitcast on CPU)."""
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    flat = np.ascontiguousarray(x).reshape(-1)  # a view where x is contiguous; 0-d ones too
    if x.dtype.itemsize == 8:
        return flat.view(np.uint32).reshape(*x.shape, 2)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return flat.view(unsigned).astype(np.uint32).reshape(x.shape)


@jax.jit
def device_fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    """Each array hashed whole, on its devices (GPUs and TPUs: one fused reduction each)."""
    return [
        _block_sum(_device_bits(x), (0,) * x.ndim, _strides_of(x), jnp)
        for x in map(_as_array, leaves)
    ]


def _host_sum(data: np.ndarray, offsets: tuple[int, ...], strides: tuple[int, ...]) -> np.uint32:
    """:func:`_block_sum` of the host block ``data`` taken in blocks of its leading dim, at most
    :data:`BLOCK_ELEMENTS` elements each (at least one row)."""
    if data.ndim == 0:
        return _block_sum(_host_bits(data), offsets, strides, np)
    rows = max(1, BLOCK_ELEMENTS // max(1, math.prod(data.shape[1:])))
    sums = [
        _block_sum(
            _host_bits(data[start : start + rows]), (offsets[0] + start, *offsets[1:]), strides, np
        )
        for start in range(0, max(1, data.shape[0]), rows)
    ]
    return np.sum(np.array(sums, dtype=np.uint32), dtype=np.uint32)


def _host_fingerprint(x: Any) -> tuple[np.uint32, bool]:
    """This process's sum for ``x`` (held on CPU devices or a host array), and whether the other
    processes hold parts of it (their sums are added)."""
    x = _as_array(x)
    strides = _strides_of(x)
    if not isinstance(x, jax.Array):
        return _host_sum(np.asarray(x), (0,) * np.ndim(x), strides), False
    sums = [
        _host_sum(np.asarray(shard.data), tuple(index.start or 0 for index in shard.index), strides)
        for shard in x.addressable_shards
        if shard.replica_id == 0  # each element once
    ]
    return np.sum(np.array(sums, dtype=np.uint32), dtype=np.uint32), not x.is_fully_addressable


def _on_cpu(x: Any) -> bool:
    sharding = getattr(x, "sharding", None)
    return sharding is None or all(d.platform == "cpu" for d in sharding.device_set)


def _device_values(leaves: list[Any]) -> list[int]:
    return [int(v) for v in jax.device_get(device_fingerprints(leaves))]


def _host_values(leaves: list[Any]) -> list[int]:
    found = [_host_fingerprint(leaf) for leaf in leaves]
    totals = np.array([total for total, _ in found], dtype=np.uint32)
    shared = [parted for _, parted in found]
    if any(shared):  # the processes hold parts of some leaves: add the processes' sums
        gathered = multihost_utils.process_allgather(totals)  # (processes, leaves)
        totals = np.where(shared, gathered.sum(axis=0, dtype=np.uint32), totals)
    return [int(v) for v in totals]


def fingerprints(state: Any) -> dict[str, int]:
    """Per-leaf fingerprints of a pytree of arrays, keyed by state path (blocks on the arrays;
    every process calls it, with the same state)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = [leaf for _, leaf in flat]
    values = _device_values(leaves) if not all(map(_on_cpu, leaves)) else _host_values(leaves)
    return {path_str(path): value for (path, _), value in zip(flat, values, strict=True)}
