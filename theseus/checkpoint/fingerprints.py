"""Fingerprints of a checkpoint's arrays: exact uint32 hashes of every element's bits and position
that do not depend on the layout or device count the arrays are held in, so a restore under
another policy checks the same numbers that were saved.

On CPU devices each device hashes its own shard in blocks of rows (:data:`BLOCK_ELEMENTS` elements
at a time), so computing the fingerprints of a state needs no second copy of it: XLA on CPU does not
fuse the element hashes into the sum, and hashing a whole shard at once holds a uint32 array of the
shard's size per leaf (on CPU devices, host memory). XLA fuses them into one reduction on GPUs and
TPUs, so there each array is hashed whole, in one pass, as before.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from theseus.sharding.layout import path_str

#: Elements of one shard hashed at once on a device (a uint32 block of 16 MiB).
BLOCK_ELEMENTS = 2**18


def _mix(h: jax.Array) -> jax.Array:
    """A bijection of uint32 (murmur3's finaliser)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
    """Each element's bits as uint32 (8-byte elements as two words: a trailing dim of 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    itemsize = np.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (in elements), modulo 2**32."""
    return tuple(math.prod(shape[dim + 1 :]) % 2**32 for dim in range(len(shape)))


def _block_sum(x: jax.Array, offsets: tuple, strides: tuple[int, ...]) -> jax.Array:
    """Sum (mod 2**32) of the element hashes of the block ``x``, whose first element sits at the
    global coordinates ``offsets`` of an array with row-major ``strides`` (of its bits)."""
    bits = _bits(x)  # (*x.shape[, 2])
    index = jnp.zeros(bits.shape, jnp.uint32)
    for dim in range(bits.ndim):
        coord = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim)
        if dim < len(offsets):
            coord = coord + jnp.asarray(offsets[dim], jnp.uint32)
        index = index + coord * jnp.uint32(strides[dim])
    hashed = _mix(bits ^ _mix(index * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15)))
    return jnp.sum(hashed, dtype=jnp.uint32)


def _rows_sum(x: jax.Array, offsets: tuple, strides: tuple[int, ...]) -> jax.Array:
    """:func:`_block_sum` of ``x`` taken in blocks of its leading dim, at most
    :data:`BLOCK_ELEMENTS` elements each (at least one row)."""
    if x.ndim == 0:
        return _block_sum(x, offsets, strides)
    rows = x.shape[0]
    block = max(1, BLOCK_ELEMENTS // max(1, math.prod(x.shape[1:])))
    if rows <= block:
        return _block_sum(x, offsets, strides)
    full = rows // block

    def body(i: jax.Array, total: jax.Array) -> jax.Array:
        start = i * block
        part = jax.lax.dynamic_slice_in_dim(x, start, block, axis=0)
        row = jnp.asarray(offsets[0], jnp.uint32) + start.astype(jnp.uint32)
        return total + _block_sum(part, (row, *offsets[1:]), strides)

    total = jax.lax.fori_loop(0, full, body, jnp.uint32(0))
    if rows % block:
        row = jnp.asarray(offsets[0], jnp.uint32) + jnp.uint32(full * block)
        total = total + _block_sum(x[full * block :], (row, *offsets[1:]), strides)
    return total


def _shard_offset(entry: Any, local: int, mesh_shape: dict[str, int]) -> jax.Array:
    """Inside ``shard_map``: the global coordinate where this device's shard of a dim starts,
    for the dim's entry of the partition spec (None, an axis name or a tuple of them)."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    position = jnp.uint32(0)
    for axis in axes:
        position = position * jnp.uint32(mesh_shape[axis]) + jax.lax.axis_index(axis).astype(
            jnp.uint32
        )
    return position * jnp.uint32(local)


#: How :func:`_leaf_fingerprint` walks a leaf: the whole array at once (its shards are at most
#: a block), in blocks of rows (it is whole on every device that holds it), or else shard by
#: shard (a mesh and a full partition spec).
WHOLE, ROWS = "whole", "rows"


def _layout(leaf: Any) -> str | tuple[Any, tuple]:
    """How to walk ``leaf`` (see :data:`WHOLE`): decided outside ``jit`` from its sharding."""
    sharding = getattr(leaf, "sharding", None)
    devices = sharding.device_set if sharding is not None else jax.devices()[:1]
    if any(device.platform != "cpu" for device in devices):
        return WHOLE  # fused into one reduction: no temporary the size of the array
    if not isinstance(sharding, NamedSharding) or sharding.is_fully_replicated:
        return ROWS
    try:
        local = sharding.shard_shape(tuple(leaf.shape))
    except ValueError:  # shards of unequal sizes: no common shard shape
        return WHOLE
    if math.prod(local) <= BLOCK_ELEMENTS:
        return WHOLE
    spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
    return sharding.mesh, spec


def _leaf_fingerprint(x: jax.Array, layout: str | tuple[Any, tuple] = WHOLE) -> jax.Array:
    """An exact uint32 hash of an array's bits and positions (``layout``: see :func:`_layout`).

    Element hashes are summed modulo 2**32, which is associative and commutative, so the value
    does not depend on the layout (or device count) the array is held in, nor on the blocks it
    is summed in. Changing any one element always changes it.
    """
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    extra = (2,) if np.dtype(x.dtype).itemsize == 8 else ()
    strides = _strides((*x.shape, *extra))
    if layout == WHOLE:
        return _block_sum(x, (0,) * x.ndim, strides)
    if layout == ROWS:
        return _rows_sum(x, (0,) * x.ndim, strides)
    assert isinstance(layout, tuple)  # WHOLE and ROWS returned above: a (mesh, spec) pair
    mesh, spec = layout
    local = NamedSharding(mesh, PartitionSpec(*spec)).shard_shape(x.shape)
    used = tuple(
        axis
        for entry in spec
        if entry is not None
        for axis in ((entry,) if isinstance(entry, str) else entry)
    )

    def per_device(shard: jax.Array) -> jax.Array:  # shard: (*local)
        offsets = tuple(
            _shard_offset(entry, size, dict(mesh.shape))
            for entry, size in zip(spec, local, strict=True)
        )
        return jax.lax.psum(_rows_sum(shard, offsets, strides), used)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=PartitionSpec(*spec),
        out_specs=PartitionSpec(),
        check_vma=False,
    )(x)


@functools.partial(jax.jit, static_argnums=1)
def _fingerprints_jit(leaves, layouts):
    return [_leaf_fingerprint(x, layout) for x, layout in zip(leaves, layouts, strict=True)]


def fingerprints(state: Any) -> dict[str, int]:
    """Per-leaf fingerprints of a pytree of arrays, keyed by state path (blocks on the arrays)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = [leaf for _, leaf in flat]
    values = jax.device_get(_fingerprints_jit(leaves, tuple(_layout(leaf) for leaf in leaves)))
    return {path_str(path): int(value) for (path, _), value in zip(flat, values, strict=True)}
