"""The bounded KV cache of :class:`theseus.model.cached_decoder.CachedDecoder`: layers grouped
by their attention window (:class:`CacheGroup`), each group's cache a ring of its window
(full-context layers: of every position) whose slots keep their key positions as data, and one
call's writes into a ring (:class:`Ring`)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from theseus.model.attention import AttentionMask

#: The key position of a cache slot nothing was written to: later than every query, so no query
#: reads it (and a kernel that skips keys past every query's position never computes it).
EMPTY = int(jnp.iinfo(jnp.int32).max)


@dataclass(frozen=True)
class CacheGroup:
    """The layers (their indices, in order) that attend with one ``window`` (None: the whole
    context), and so share one cache layout: ``length(cache_len)`` slots per row, position ``p``
    in slot ``p mod length``. A sliding group's ring holds its window, a full group every
    position."""

    name: str
    window: int | None
    layers: tuple[int, ...]

    def length(self, cache_len: int) -> int:
        return cache_len if self.window is None else min(self.window, cache_len)


def cache_groups(windows: tuple[int | None, ...], num_layers: int) -> tuple[CacheGroup, ...]:
    """The layers grouped by window (full context first, then windows in increasing order)."""
    windows = windows or (None,) * num_layers
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    return tuple(
        CacheGroup(
            "full" if w is None else f"window_{w}",
            w,
            tuple(i for i, layer_window in enumerate(windows) if layer_window == w),
        )
        for w in kinds
    )


@dataclass(frozen=True)
class Ring:
    """One call's writes into one group's cache: where each new position goes (``slots``
    (rows, n); the slot count, out of range, for a position not kept), the slots' key positions
    ``before`` and ``after`` the call (rows, length), the queries' ``positions`` (rows, n), the
    group's ``window``, and whether the queries read keys the write evicts (``read_first``: a
    call of more new positions than the ring's slack, such as the prefill of a prompt longer
    than the window), in which case they attend over the cache before the write and the new
    keys together instead of over the cache after it."""

    slots: jax.Array
    before: jax.Array
    after: jax.Array
    positions: jax.Array
    window: int | None
    read_first: bool

    @staticmethod
    def of(group: CacheGroup, before: jax.Array, positions: jax.Array, lengths: jax.Array) -> Ring:
        """The writes of queries at ``positions`` (rows, n) into a group's cache whose slots
        hold key positions ``before`` (rows, length): of each row's first ``lengths`` (rows,)
        new positions (the rest is padding), the last ``length`` ones."""
        num_new = positions.shape[1]
        length = before.shape[1]
        index = jnp.arange(num_new)[None]  # (1, n)
        kept = (index < lengths[:, None]) & (index >= lengths[:, None] - length)  # (rows, n)
        slots = jnp.where(kept, positions % length, length)  # (rows, n)
        stale = before >= positions[:, :1]  # (rows, length): at or past the first new position
        before = jnp.where(stale, EMPTY, before)
        window = group.window
        evicts = window is not None and length >= window
        read_first = window is not None and evicts and num_new > length - window + 1
        after = _write(before[..., None], positions[..., None], slots)[..., 0]
        return Ring(slots, before, after, positions, group.window, read_first)

    @property
    def mask(self) -> AttentionMask:
        """What the queries read of :meth:`write`'s keys."""
        key_positions = self.after
        if self.read_first:
            key_positions = jnp.concatenate([self.before, self.positions], axis=1)
        return AttentionMask(self.positions, key_positions, window=self.window)

    def write(self, cache: jax.Array, new: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``cache`` (rows, length, width) with ``new`` (rows, n, width) written, and what the
        queries read: the written cache, or (``read_first``) the cache before the write and
        the new entries (rows, length + n, width)."""
        new = new.astype(cache.dtype)
        written = _write(cache, new, self.slots)
        if self.read_first:
            return written, jnp.concatenate([cache, new], axis=1)
        return written, written


def _write(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """``cache`` (rows, length, width) with ``new`` (rows, n, width) written at ``slots`` (rows,
    n); a slot out of range writes nothing."""
    return jax.vmap(lambda c, u, s: c.at[s].set(u, mode="drop"))(cache, new, slots)
