"""Fingerprints of a checkpoint's arrays: exact uint32 hashes of every element's bits and position
that do not depend on the layout or device count the arrays are held in, so a restore under
another policy checks the same numbers that were saved."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from theseus.sharding.layout import path_str


def _mix(h: jax.Array) -> jax.Array:
    """A bijection of uint32 (murmur3's finaliser)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """An exact uint32 hash of an array's bits and positions.

    Element hashes are summed modulo 2**32, which is associative and commutative, so the value
    does not depend on the layout (or device count) the array is held in. Changing any one element
    always changes it.
    """
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        itemsize = np.dtype(x.dtype).itemsize
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
        bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * jnp.uint32(
            stride % 2**32
        )
        stride *= bits.shape[dim]
    hashed = _mix(bits ^ _mix(index * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15)))
    return jnp.sum(hashed, dtype=jnp.uint32)


_fingerprints_jit = jax.jit(lambda tree: jax.tree.map(_leaf_fingerprint, tree))


def fingerprints(state: Any) -> dict[str, int]:
    """Per-leaf fingerprints of a pytree of arrays, keyed by state path (blocks on the arrays)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    values = jax.device_get(_fingerprints_jit([leaf for _, leaf in flat]))
    return {path_str(path): int(value) for (path, _), value in zip(flat, values, strict=True)}
