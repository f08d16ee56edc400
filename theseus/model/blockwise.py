"""Blockwise attention (FlashAttention-2 in JAX): memory linear in the context, and no work for the
blocks a mask leaves empty.

Queries are cut in blocks of ``block_q`` rows, keys and values in blocks of ``block_k``. Each block
is summarised by the least and greatest position and segment id it holds, which gives a
conservative block-level visibility (n_q_blocks × n_k_blocks per batch row: blocks, never tokens):
key block ``j`` may be read by query block ``i`` when its first position is not after ``i``'s last,
its last is less than a window before ``i``'s first, and their segment ranges overlap. Each query
block's visible key blocks are compacted into a list and a count (and each key block's query
blocks, for the key pass of the backward), and the loops run over that list with the count as a
traced trip count: a skipped block costs nothing (a ``lax.cond`` under ``vmap`` would become a
select, so skipping comes from loop bounds). Inside a visited block the exact mask is built from
that block's positions and segments only. An online softmax with float32 running maximum and sum
gives the output; a custom VJP keeps the output and the log-sum-exp only and recomputes the
probabilities per block, once per query block (dQ) and once per key block (dK, dV).

Lengths that are not a multiple of the block are padded inside: padded keys are never visible,
padded query rows are dropped from the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np


class Mask(Protocol):
    """What the kernel reads of :class:`theseus.model.attention.AttentionMask` (which imports
    this module to dispatch to it)."""

    @property
    def query_positions(self) -> jax.Array: ...

    @property
    def key_positions(self) -> jax.Array: ...

    @property
    def query_segments(self) -> jax.Array | None: ...

    @property
    def key_segments(self) -> jax.Array | None: ...

    @property
    def window(self) -> int | jax.Array | None: ...


#: A window no position difference reaches (the whole context), as attention.NO_WINDOW.
_WHOLE_CONTEXT = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class BlockCount:
    """Blocks of the (query block × key block) grid the kernel computes for a mask, summed over
    the batch rows of the mask, against the whole grid's ``total``."""

    computed: int
    total: int


@dataclass(frozen=True)
class _Tiling:
    """The static shape of one call: block sizes (clamped to the lengths), true lengths, scale
    and soft cap."""

    block_q: int
    block_k: int
    q_len: int
    k_len: int
    scale: float
    softcap: float | None

    @property
    def n_q_blocks(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def n_k_blocks(self) -> int:
        return -(-self.k_len // self.block_k)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _Bounds:
    """A block-level mask, compacted: for each (batch row, query block) the key blocks to visit
    (visible first) and how many; the same for each (batch row, key block) and its query blocks."""

    key_blocks: jax.Array  # (batch, n_q_blocks, n_k_blocks) int32
    key_counts: jax.Array  # (batch, n_q_blocks) int32
    query_blocks: jax.Array  # (batch, n_k_blocks, n_q_blocks) int32
    query_counts: jax.Array  # (batch, n_k_blocks) int32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _Tokens:
    """The mask's per-token data, broadcast over the batch and padded to whole blocks (by
    repeating the last token, so block summaries are unchanged; the kernel masks padded keys by
    index)."""

    query_positions: jax.Array  # (batch, padded q_len) int32
    key_positions: jax.Array  # (batch, padded k_len) int32
    query_segments: jax.Array | None  # (batch, padded q_len) int32
    key_segments: jax.Array | None  # (batch, padded k_len) int32
    window: jax.Array  # () int32


def _padded(x: jax.Array, block: int, dim: int, mode: str = "constant") -> jax.Array:
    """``x`` padded along ``dim`` to a multiple of ``block``."""
    pad = -x.shape[dim] % block
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def _tokens(mask: Mask, batch: int, tiling: _Tiling) -> _Tokens:
    """The mask's arrays as the kernel reads them."""

    def rows(x: jax.Array, length: int, block: int) -> jax.Array:
        x = jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, length))
        return _padded(x, block, 1, mode="edge")

    def segments(x: jax.Array | None, length: int, block: int) -> jax.Array | None:
        return None if x is None else rows(x, length, block)

    q_len, k_len, bq, bk = tiling.q_len, tiling.k_len, tiling.block_q, tiling.block_k
    window = _WHOLE_CONTEXT if mask.window is None else mask.window
    return _Tokens(
        rows(mask.query_positions, q_len, bq),
        rows(mask.key_positions, k_len, bk),
        segments(mask.query_segments, q_len, bq),
        segments(mask.key_segments, k_len, bk),
        jnp.asarray(window, jnp.int32),
    )


def _ranges(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Least and greatest value of each block of ``x`` (batch, n_blocks · block)."""
    blocks = x.reshape(x.shape[0], -1, block)  # (batch, n_blocks, block)
    return blocks.min(-1), blocks.max(-1)


def _block_visibility(tokens: _Tokens, tiling: _Tiling) -> jax.Array:
    """Whether key block ``j`` may hold a key that query block ``i`` reads: bool (batch,
    n_q_blocks, n_k_blocks). Conservative: a visible block may still be empty, an invisible one
    is."""
    q_min, q_max = _ranges(tokens.query_positions, tiling.block_q)  # (batch, n_q_blocks)
    k_min, k_max = _ranges(tokens.key_positions, tiling.block_k)  # (batch, n_k_blocks)
    visible = k_min[:, None, :] <= q_max[:, :, None]
    visible &= (q_min[:, :, None] - k_max[:, None, :]) < tokens.window
    if tokens.query_segments is not None and tokens.key_segments is not None:
        qs_min, qs_max = _ranges(tokens.query_segments, tiling.block_q)
        ks_min, ks_max = _ranges(tokens.key_segments, tiling.block_k)
        visible &= (ks_min[:, None, :] <= qs_max[:, :, None]) & (
            qs_min[:, :, None] <= ks_max[:, None, :]
        )
    return visible  # (batch, n_q_blocks, n_k_blocks)


def _compacted(visible: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The indices along the last dimension with the visible ones first, and their count."""
    order = jnp.argsort(~visible, axis=-1, stable=True).astype(jnp.int32)
    return order, visible.sum(-1, dtype=jnp.int32)


def _bounds(tokens: _Tokens, tiling: _Tiling) -> _Bounds:
    visible = _block_visibility(tokens, tiling)  # (batch, n_q_blocks, n_k_blocks)
    key_blocks, key_counts = _compacted(visible)
    query_blocks, query_counts = _compacted(visible.transpose(0, 2, 1))
    return _Bounds(key_blocks, key_counts, query_blocks, query_counts)


def _tiling(q: jax.Array, k: jax.Array, scale, softcap, block_q: int, block_k: int) -> _Tiling:
    q_len, k_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    scale = float(1.0 / np.sqrt(head_dim)) if scale is None else float(scale)
    return _Tiling(min(block_q, q_len), min(block_k, k_len), q_len, k_len, scale, softcap)


def blocks_computed(mask: Mask, q_len: int, k_len: int, block_q: int, block_k: int) -> BlockCount:
    """How many (query block, key block) pairs :func:`blockwise_attention` computes for ``mask``
    (the same visibility its loops run over), summed over the mask's batch rows."""
    batch = max(
        np.shape(x)[0]
        for x in (mask.query_positions, mask.key_positions, mask.query_segments)
        if x is not None
    )
    tiling = _Tiling(min(block_q, q_len), min(block_k, k_len), q_len, k_len, 1.0, None)
    visible = _block_visibility(_tokens(mask, batch, tiling), tiling)
    return BlockCount(int(visible.sum()), int(visible.size))


@dataclass(frozen=True)
class _QueryBlock:
    """One block of queries of one batch row: queries (block_q, n_kv, group, head_dim), their
    positions and segments (block_q,)."""

    q: jax.Array
    positions: jax.Array
    segments: jax.Array | None


@dataclass(frozen=True)
class _KeyBlock:
    """One block of keys of one batch row: keys and values (block_k, n_kv, head_dim), their
    positions, segments and indices in the sequence (block_k,)."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    segments: jax.Array | None
    index: jax.Array


def _slice_block(x: jax.Array, row, j, block: int) -> jax.Array:
    """Block ``j`` of batch row ``row`` of ``x`` (batch, padded length, ...)."""
    start = (row, j * block) + (0,) * (x.ndim - 2)
    return jax.lax.dynamic_slice(x, start, (1, block, *x.shape[2:]))[0]


def _maybe_slice(x: jax.Array | None, row, j, block: int) -> jax.Array | None:
    return None if x is None else _slice_block(x, row, j, block)


def _query_block(q, tokens: _Tokens, row, i, block: int) -> _QueryBlock:
    """Block ``i`` of row ``row``; ``q`` (batch, padded q_len, n_kv, group, head_dim)."""
    return _QueryBlock(
        _slice_block(q, row, i, block),
        _slice_block(tokens.query_positions, row, i, block),
        _maybe_slice(tokens.query_segments, row, i, block),
    )


def _key_block(k, v, tokens: _Tokens, row, j, block: int) -> _KeyBlock:
    """Block ``j`` of row ``row``; ``k``, ``v`` (batch, padded k_len, n_kv, head_dim)."""
    return _KeyBlock(
        _slice_block(k, row, j, block),
        _slice_block(v, row, j, block),
        _slice_block(tokens.key_positions, row, j, block),
        _maybe_slice(tokens.key_segments, row, j, block),
        j * block + jnp.arange(block),
    )


def _block_scores(queries: _QueryBlock, keys: _KeyBlock, window, tiling: _Tiling):
    """Scores of one block pair after the soft cap, -inf where the exact mask hides them, and the
    tanh of the capped scores (None uncapped, for the backward): float32 (n_kv, group, block_q,
    block_k)."""
    raw = jnp.einsum("qhgd,khd->hgqk", queries.q, keys.k, preferred_element_type=jnp.float32)
    raw = raw * jnp.float32(tiling.scale)  # (n_kv, group, block_q, block_k)
    if tiling.softcap is None:
        capped, tanh = raw, None
    else:
        tanh = jnp.tanh(raw / jnp.float32(tiling.softcap))
        capped = tanh * jnp.float32(tiling.softcap)
    q_pos, k_pos = queries.positions[:, None], keys.positions[None, :]
    visible = (k_pos <= q_pos) & (q_pos - k_pos < window)  # (block_q, block_k)
    visible &= keys.index[None, :] < tiling.k_len
    if queries.segments is not None and keys.segments is not None:
        visible &= queries.segments[:, None] == keys.segments[None, :]
    return jnp.where(visible, capped, -jnp.inf), tanh


def _forward(q, k, v, tokens: _Tokens, bounds: _Bounds, tiling: _Tiling):
    """Output (batch, q_len, n_heads, head_dim) in q.dtype and log-sum-exp float32 (batch,
    n_q_blocks, n_kv, group, block_q)."""
    batch, q_len, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    group = n_heads // n_kv
    bq, bk, nq = tiling.block_q, tiling.block_k, tiling.n_q_blocks
    q = _padded(q, bq, 1).reshape(batch, nq * bq, n_kv, group, head_dim)
    k, v = _padded(k, bk, 1), _padded(v, bk, 1)  # (batch, padded k_len, n_kv, head_dim)

    def query_block(task):
        row, i = task // nq, task % nq
        queries = _query_block(q, tokens, row, i, bq)

        def visit(t, carry):
            top, total, acc = carry
            keys = _key_block(k, v, tokens, row, bounds.key_blocks[row, i, t], bk)
            scores, _ = _block_scores(queries, keys, tokens.window, tiling)  # (h, g, bq, bk)
            new_top = jnp.maximum(top, scores.max(-1))  # (n_kv, group, block_q)
            safe = jnp.where(new_top == -jnp.inf, 0.0, new_top)
            probs = jnp.exp(scores - safe[..., None])
            rescale = jnp.exp(top - safe)
            total = total * rescale + probs.sum(-1)
            pv = jnp.einsum(
                "hgqk,khd->hgqd", probs.astype(v.dtype), keys.v, preferred_element_type=jnp.float32
            )
            return new_top, total, acc * rescale[..., None] + pv

        stats = jnp.full((n_kv, group, bq), -jnp.inf, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros((n_kv, group, bq, head_dim), jnp.float32))
        top, total, acc = jax.lax.fori_loop(0, bounds.key_counts[row, i], visit, init)
        out = acc / jnp.where(total == 0.0, 1.0, total)[..., None]  # (n_kv, group, bq, d)
        lse = top + jnp.log(total)  # -inf for a row that reads no key
        return out.transpose(2, 0, 1, 3).astype(q.dtype), lse

    tasks = jnp.arange(batch * nq, dtype=jnp.int32)
    out, lse = jax.lax.map(query_block, tasks)  # (batch·nq, bq, n_kv, group, d), (.., h, g, bq)
    out = out.reshape(batch, nq * bq, n_heads, head_dim)[:, :q_len]
    return out, lse.reshape(batch, nq, n_kv, group, bq)


def _block_grads(queries, keys, d_out, lse, delta, window, tiling):
    """Probabilities and the cotangent of the raw product q·k of one block pair, float32
    (n_kv, group, block_q, block_k) each; ``d_out`` (block_q, n_kv, group, head_dim), ``lse``
    and ``delta`` (n_kv, group, block_q)."""
    scores, tanh = _block_scores(queries, keys, window, tiling)
    probs = jnp.exp(scores - lse[..., None])  # (n_kv, group, block_q, block_k)
    dprobs = jnp.einsum("qhgd,khd->hgqk", d_out, keys.v, preferred_element_type=jnp.float32)
    dscores = probs * (dprobs - delta[..., None])
    if tanh is not None:
        dscores = dscores * (1.0 - tanh * tanh)
    return probs, dscores * jnp.float32(tiling.scale)


def _backward(q, k, v, out, lse, d_out, tokens: _Tokens, bounds: _Bounds, tiling: _Tiling):
    """dq, dk, dv in the inputs' dtypes: a pass per query block over its key blocks (dq, and
    each row's sum of d_out · out), then one per key block over its query blocks (dk, dv)."""
    batch, q_len, n_heads, head_dim = q.shape
    k_len, n_kv = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    bq, bk, nq, nk = tiling.block_q, tiling.block_k, tiling.n_q_blocks, tiling.n_k_blocks
    # An -inf log-sum-exp (a row that reads nothing) makes every probability exp(-inf) = 0.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # (batch, nq, n_kv, group, bq)
    q, out, d_out = (
        _padded(x, bq, 1).reshape(batch, nq * bq, n_kv, group, head_dim) for x in (q, out, d_out)
    )
    k, v = _padded(k, bk, 1), _padded(v, bk, 1)  # (batch, padded k_len, n_kv, head_dim)

    def query_pass(task):
        row, i = task // nq, task % nq
        queries = _query_block(q, tokens, row, i, bq)
        do_blk = _slice_block(d_out, row, i, bq)  # (block_q, n_kv, group, head_dim)
        delta = jnp.einsum(
            "qhgd,qhgd->hgq",
            do_blk,
            _slice_block(out, row, i, bq),
            preferred_element_type=jnp.float32,
        )  # (n_kv, group, block_q)

        def visit(t, dq):
            keys = _key_block(k, v, tokens, row, bounds.key_blocks[row, i, t], bk)
            _, dscores = _block_grads(
                queries, keys, do_blk, lse[row, i], delta, tokens.window, tiling
            )
            return dq + jnp.einsum(
                "hgqk,khd->qhgd",
                dscores.astype(k.dtype),
                keys.k,
                preferred_element_type=jnp.float32,
            )

        dq = jnp.zeros((bq, n_kv, group, head_dim), jnp.float32)
        dq = jax.lax.fori_loop(0, bounds.key_counts[row, i], visit, dq)
        return dq.astype(q.dtype), delta

    def key_pass(task):
        row, j = task // nk, task % nk
        keys = _key_block(k, v, tokens, row, j, bk)

        def visit(t, carry):
            dk, dv = carry
            i = bounds.query_blocks[row, j, t]
            queries = _query_block(q, tokens, row, i, bq)
            do_blk = _slice_block(d_out, row, i, bq)
            probs, dscores = _block_grads(
                queries, keys, do_blk, lse[row, i], deltas[row, i], tokens.window, tiling
            )
            dv = dv + jnp.einsum(
                "hgqk,qhgd->khd",
                probs.astype(v.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
            )
            dk = dk + jnp.einsum(
                "hgqk,qhgd->khd",
                dscores.astype(q.dtype),
                queries.q,
                preferred_element_type=jnp.float32,
            )
            return dk, dv

        zeros = jnp.zeros((bk, n_kv, head_dim), jnp.float32)
        dk, dv = jax.lax.fori_loop(0, bounds.query_counts[row, j], visit, (zeros, zeros))
        return dk.astype(k.dtype), dv.astype(v.dtype)

    dq, deltas = jax.lax.map(query_pass, jnp.arange(batch * nq, dtype=jnp.int32))
    deltas = deltas.reshape(batch, nq, n_kv, group, bq)
    dk, dv = jax.lax.map(key_pass, jnp.arange(batch * nk, dtype=jnp.int32))
    dq = dq.reshape(batch, nq * bq, n_heads, head_dim)[:, :q_len]
    dk = dk.reshape(batch, nk * bk, n_kv, head_dim)[:, :k_len]
    dv = dv.reshape(batch, nk * bk, n_kv, head_dim)[:, :k_len]
    return dq, dk, dv


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q, k, v, tokens: _Tokens, tiling: _Tiling):
    out, _ = _forward(q, k, v, tokens, _bounds(tokens, tiling), tiling)
    return out


def _attend_fwd(q, k, v, tokens, tiling):
    out, lse = _forward(q, k, v, tokens, _bounds(tokens, tiling), tiling)
    return out, (q, k, v, tokens, out, lse)


def _attend_bwd(tiling, residuals, d_out):
    q, k, v, tokens, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, out, lse, d_out, tokens, _bounds(tokens, tiling), tiling)
    d_tokens = jax.tree.map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), tokens)
    return dq, dk, dv, d_tokens


_attend.defvjp(_attend_fwd, _attend_bwd)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Mask,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int,
    block_k: int,
) -> jax.Array:
    """Attention of ``q`` (batch, q_len, n_heads, head_dim) over ``k``, ``v`` (batch, k_len,
    n_kv_heads, head_dim) under ``mask``, as :func:`theseus.model.attention.attention` computes it
    (grouped-query, float32 scores times ``scale``, soft-capped at ``softcap``), in blocks of
    ``block_q`` queries and ``block_k`` keys that skip what the mask hides. Output in q.dtype."""
    tiling = _tiling(q, k, scale, softcap, block_q, block_k)
    return _attend(q, k, v, _tokens(mask, q.shape[0], tiling), tiling)
