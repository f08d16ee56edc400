"""The one attention of every decoder, in training and in KV-cache decoding.

Which keys a query reads is data, an :class:`AttentionMask`: the positions of the queries and of
the keys (training: ``arange`` of the sequence; decoding: the rows' positions and the cache's),
optionally the segment of each (packed rows: a query reads keys of its own segment only) and a
window (a query reads the ``window`` latest positions up to its own, as Hugging Face's sliding
window: key ``k`` is read by query ``q`` when ``q - window < k <= q``). The mask is a pytree, so
its arrays, the window among them, may be traced (one window per layer through
:func:`theseus.scan_layers`, :data:`NO_WINDOW` for a layer that reads the whole context).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from theseus.model.layers import apply_dropout

#: The window of a layer that attends the whole context (no position is that far back).
NO_WINDOW = int(jnp.iinfo(jnp.int32).max)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMask:
    """What keys each query reads: a key at a position up to the query's own, of the same
    segment when segments are given, at most ``window - 1`` positions before it when a window
    is given. Positions and segments are int arrays ``(batch or 1, length)``."""

    query_positions: jax.Array
    key_positions: jax.Array
    query_segments: jax.Array | None = None
    key_segments: jax.Array | None = None
    window: int | jax.Array | None = None

    @staticmethod
    def causal(seq: int) -> AttentionMask:
        """Training's mask: each of ``seq`` positions reads itself and the ones before."""
        positions = jnp.arange(seq)[None]  # (1, seq)
        return AttentionMask(positions, positions)

    @staticmethod
    def cached(query_positions: jax.Array, cache_len: int) -> AttentionMask:
        """Decoding's mask: queries at ``query_positions`` (rows, n) read a cache of
        ``cache_len`` positions up to their own (later entries are padding or stale)."""
        return AttentionMask(query_positions, jnp.arange(cache_len)[None])

    def visible(self) -> jax.Array:
        """Whether query ``q`` reads key ``k``: bool ``(batch or 1, 1, q_len, k_len)``."""
        queries = self.query_positions[:, :, None]  # (batch, q_len, 1)
        keys = self.key_positions[:, None, :]  # (batch, 1, k_len)
        visible = keys <= queries
        if self.query_segments is not None and self.key_segments is not None:
            same = self.query_segments[:, :, None] == self.key_segments[:, None, :]
            visible = visible & same
        if self.window is not None:
            visible = visible & (queries - keys < self.window)
        return visible[:, None]  # (batch, 1, q_len, k_len)


@dataclass(frozen=True)
class AttentionOptions:
    """How a layer attends besides its mask, as one hashable value a family's decoder carries
    (``Skeleton.attention``): ``scale`` multiplies the scores (None: 1 / sqrt(head_dim)) and
    ``softcap`` caps them at ``±cap`` (None: uncapped). A new attention option is a field here,
    passed to :func:`attention` as the keyword of its name."""

    scale: float | None = None
    softcap: float | None = None

    def keywords(self) -> dict:
        """The options as :func:`attention`'s keywords."""
        return {"scale": self.scale, "softcap": self.softcap}


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap · tanh(x / cap)``: ``x`` squashed into (-cap, cap) (Gemma 2's soft-capping); None:
    ``x`` as it is."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_rate: float = 0.0,
    keep: jax.Array | None = None,
) -> jax.Array:
    """Multi-head attention of queries ``q`` (batch, q_len, n_heads, head_dim) over keys and
    values ``k``, ``v`` (batch, k_len, n_kv_heads, head_dim), grouped-query when n_kv_heads
    divides n_heads (query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``).
    Float32 scores times ``scale`` (None: 1 / sqrt(head_dim)), soft-capped at ``softcap`` (None:
    not), and softmax; probabilities and output in ``q.dtype``. Returns (batch, q_len, n_heads,
    head_dim).

    Without soft-capping and dropout it is :func:`jax.nn.dot_product_attention` with the mask as
    its boolean ``mask`` argument, so the backend's fused kernel can serve it where it supports
    one. A soft cap, or a ``keep`` mask (batch, n_heads, q_len, k_len) dropping probabilities out
    at ``dropout_rate``, is what the fused function does not do: the same product is written out.
    """
    if keep is None and softcap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask.visible(), scale=scale)
    batch, q_len, n_heads, head_dim = q.shape
    k_len, n_kv = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    q = q.reshape(batch, q_len, n_kv, group, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
    if scale is None:
        scores = scores / jnp.sqrt(jnp.float32(head_dim))  # (batch, n_kv, group, q_len, k_len)
    else:
        scores = scores * jnp.float32(scale)
    scores = soft_cap(scores, softcap)  # (batch, n_kv, group, q_len, k_len)
    scores = jnp.where(mask.visible()[:, :, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # (batch, n_kv, group, q, k)
    if keep is not None:
        keep = keep.reshape(batch, n_kv, group, q_len, k_len)
    probs = apply_dropout(probs, keep, dropout_rate)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_len, n_heads, head_dim).astype(q.dtype)
