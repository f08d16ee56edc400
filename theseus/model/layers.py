"""Mixed-precision building blocks: weight matmuls, LayerNorm, RMSNorm and dropout.

Parameters are float32 master weights. Matmuls run in the dtype of their input activations (the
compute dtype) and accumulate in float32; LayerNorm statistics and softmax are float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from theseus.sharding.layer_scan import (
    MATMUL,
    gathered_source,
    move_to_compute,
    reduce_to_storage,
)


def dense(
    x: jax.Array, w: jax.Array, out_dtype: DTypeLike | None = None, *, transposed: bool = False
) -> jax.Array:
    """``x @ w`` (``x @ w.T`` when ``transposed``) in ``x.dtype`` with float32 accumulation; the
    result is cast to ``out_dtype`` (default ``x.dtype``).

    ``w`` is the float32 master weight, ``(d_in, d_out)`` or, when ``transposed``, ``(d_out,
    d_in)``: a tied embedding table is used as it is stored (XLA:CPU cannot run the bfloat16
    weight-gradient dot of ``w.T``). It is cast to ``x.dtype`` inside. The backward pass computes
    the weight gradient with float32 accumulation and returns it in ``w.dtype``, so it is reduced
    over the batch (and over data replicas) in float32 rather than in the compute dtype; the
    input gradient is in ``x.dtype``.

    Inside :func:`theseus.scan_layers`, a weight the scan gathered is used through its stored
    shard: the shard is what the backward pass keeps, and it is gathered again there (JAX keeps
    a custom VJP's residuals whatever the remat policy, so saving ``w`` would keep every layer's
    gathered copy). The output is named :data:`~theseus.sharding.layer_scan.MATMUL`.
    """
    w_axes = "oi" if transposed else "io"
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    source = gathered_source(w)
    if source is None:
        out = _dense(x, w, out_dtype, w_axes)
    else:
        out = _dense_stored(x, *source, out_dtype, w_axes)
    return checkpoint_name(out, MATMUL)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x: jax.Array, w: jax.Array, out_dtype: jnp.dtype, w_axes: str) -> jax.Array:
    w = w.astype(x.dtype)
    out = jnp.einsum(f"...i,{w_axes}->...o", x, w, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)  # (..., d_out)


def _dense_fwd(x: jax.Array, w: jax.Array, out_dtype: jnp.dtype, w_axes: str):
    return _dense(x, w, out_dtype, w_axes), (x, w)


def _dense_bwd(out_dtype: jnp.dtype, w_axes: str, residuals, grad_out: jax.Array):
    x, w = residuals
    return _dense_grads(x, w, grad_out, w_axes)


def _dense_grads(x: jax.Array, w: jax.Array, grad_out: jax.Array, w_axes: str):
    """Input gradient in ``x.dtype`` and float32-accumulated weight gradient in ``w.dtype``."""
    grad_out = grad_out.astype(x.dtype)  # (..., d_out)
    w_compute = w.astype(x.dtype)
    grad_x = jnp.einsum(
        f"...o,{w_axes}->...i", grad_out, w_compute, preferred_element_type=jnp.float32
    )  # (..., d_in)
    grad_w = jnp.einsum(f"...i,...o->{w_axes}", x, grad_out, preferred_element_type=jnp.float32)
    return grad_x.astype(x.dtype), grad_w.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dense_stored(x, shard, move, out_dtype: jnp.dtype, w_axes: str) -> jax.Array:
    """:func:`_dense` of the weight that ``move`` gathers from the stored ``shard``."""
    return _dense(x, move_to_compute(shard, move), out_dtype, w_axes)


def _dense_stored_fwd(x, shard, move, out_dtype: jnp.dtype, w_axes: str):
    return _dense_stored(x, shard, move, out_dtype, w_axes), (x, shard)


def _dense_stored_bwd(move, out_dtype: jnp.dtype, w_axes: str, residuals, grad_out: jax.Array):
    x, shard = residuals
    grad_x, grad_w = _dense_grads(x, move_to_compute(shard, move), grad_out, w_axes)
    return grad_x, reduce_to_storage(grad_w, move)  # float32, back to the stored layout


_dense_stored.defvjp(_dense_stored_fwd, _dense_stored_bwd)


def layer_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array, dtype: DTypeLike, eps: float = 1e-5
) -> jax.Array:
    """LayerNorm over the last axis with float32 statistics; the result is cast to ``dtype``."""
    x = x.astype(jnp.float32)  # (..., dim)
    mean = x.mean(axis=-1, keepdims=True)  # (..., 1)
    variance = jnp.square(x - mean).mean(axis=-1, keepdims=True)  # (..., 1)
    normalized = (x - mean) * jax.lax.rsqrt(variance + eps)  # (..., dim)
    return (normalized * scale + bias).astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype: DTypeLike) -> jax.Array:
    """RMSNorm over the last axis with float32 statistics; the result is cast to ``dtype``."""
    x = x.astype(jnp.float32)  # (..., dim)
    variance = jnp.square(x).mean(axis=-1, keepdims=True)  # (..., 1)
    return (weight * (x * jax.lax.rsqrt(variance + eps))).astype(dtype)


def fold_in(keys: jax.Array | None, data: int | jax.Array) -> jax.Array | None:
    """``jax.random.fold_in`` of every key of ``keys`` (examples,) with the same ``data``: an
    independent stream per dropout site or layer. None stays None (no randomness)."""
    if keys is None:
        return None
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, data)


def keep_masks(
    keys: jax.Array | None, rate: float, shapes: Sequence[tuple[int, ...]]
) -> tuple[jax.Array | None, ...]:
    """Dropout keep masks ``(examples, *shape)``, one for each of ``shapes``, drawn from the keys
    ``(examples,)``: an example's masks depend on its key alone, so they are the same under every
    layout. Each mask is drawn in its own shape (so it shards like the activation it masks);
    an element is kept with probability ``1 - rate``. All None (no dropout) when ``keys`` is
    None (evaluation) or ``rate`` is 0."""
    if keys is None or rate == 0.0:
        return (None,) * len(shapes)
    if len(shapes) > 1:
        keys = jax.vmap(jax.random.split, in_axes=(0, None))(keys, len(shapes))  # (examples, n)
    else:
        keys = keys[:, None]  # (examples, 1)
    threshold = jnp.uint32(int(rate * 2**32))
    return tuple(
        jax.vmap(lambda key, shape=shape: jax.random.bits(key, shape, jnp.uint32))(keys[:, i])
        >= threshold
        for i, shape in enumerate(shapes)
    )


def apply_dropout(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """Inverted dropout: ``x`` where ``keep``, scaled by ``1 / (1 - rate)``, else 0; ``x`` itself
    when ``keep`` is None."""
    if keep is None:
        return x
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def dropout(x: jax.Array, rate: float, keys: jax.Array | None) -> jax.Array:
    """Inverted dropout of ``x`` (examples, ...) with one key per example, ``keys`` (examples,)."""
    return apply_dropout(x, keep_masks(keys, rate, [x.shape[1:]])[0], rate)
