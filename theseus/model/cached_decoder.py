"""Decoding with a cache of keys and values (:class:`CachedDecoder`): a family's decoder
(:mod:`theseus.model.decoder`) run on a few new tokens at a time, for ``theseus generate``.

The layers of one window share a cache (:mod:`theseus.model.kv_cache`): full-context layers keep
every position, sliding layers a ring of their window (position ``p`` in slot ``p mod window``),
and each group keeps the position of every slot as data, so the attention mask reads real key
positions and an empty slot sits at ``EMPTY``, later than any query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from theseus.model.decode import ROWS, CacheArray
from theseus.model.decoder import (
    Attended,
    LayerInputs,
    Skeleton,
    head,
    layer_runs,
    layer_slice,
    run_length,
)
from theseus.model.kv_cache import EMPTY, CacheGroup, Ring, cache_groups
from theseus.model.parts import arrays


@dataclass(frozen=True)
class CachedDecoder:
    """A family's decoder with a cache of keys and values (:class:`theseus.model.decode.Decoder`)
    per :class:`CacheGroup`: ``k`` and ``v`` of shape (layers of the group, rows, length,
    kv_width) in the compute dtype, named (``n_layer``, rows, ``names[0]``, ``names[1]``): rows
    over ``batch``, the key/value heads as the family's plan splits their projections in
    training; and ``positions`` (rows, length) int32, each slot's key position. ``graphdef``:
    the model's graph, which reads the parameter dict as typed :class:`Weights`."""

    skeleton: Skeleton
    graphdef: nnx.GraphDef
    vocab_size: int
    num_layers: int
    head_dim: int
    kv_width: int
    names: tuple[str | None, str]

    @property
    def context_len(self) -> int:
        return self.skeleton.context.length

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        return cache_groups(self.skeleton.per_layer.windows, self.num_layers)

    def cache(self, num_rows: int, cache_len: int) -> dict[str, dict[str, CacheArray]]:
        dtype = self.skeleton.compute_dtype
        arrays = {}
        for group in self.groups:
            length = group.length(cache_len)
            shape = (len(group.layers), num_rows, length, self.kv_width)
            kv = CacheArray(shape, dtype, ("n_layer", ROWS, *self.names))
            positions = CacheArray((num_rows, length), jnp.int32, (ROWS, None), fill=EMPTY)
            arrays[group.name] = {"k": kv, "v": kv, "positions": positions}
        return arrays

    def __call__(
        self,
        params: Any,
        cache: dict[str, dict[str, jax.Array]],
        tokens: jax.Array,
        positions: jax.Array,
        lengths: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, dict[str, jax.Array]]]:
        sk = self.skeleton
        weights = arrays(nnx.merge(self.graphdef, params).weights())
        rows, num_new = tokens.shape
        query_positions = positions[:, None] + jnp.arange(num_new)  # (rows, n)
        if lengths is None:
            lengths = jnp.full((rows,), num_new, jnp.int32)
        x = sk.embed(weights, tokens, query_positions, sk.settings)  # (rows, n, n_embd)
        features = sk.features(query_positions, sk.settings)
        groups = self.groups
        rings = [Ring.of(g, cache[g.name]["positions"], query_positions, lengths) for g in groups]

        def group_attention(group: int, q, k, v, index):
            """Write ``k``, ``v`` (rows, n, kv_heads, head_dim) into layer ``index`` of
            ``group``'s stacks and attend with queries ``q``: (output, the group's stacks)."""

            def attend(stacks):
                ring, read = rings[group], {}
                for name, new in (("k", k), ("v", v)):
                    stack = stacks[name]  # (layers of the group, rows, length, kv_width)
                    written, read[name] = ring.write(stack[index], new.reshape(rows, num_new, -1))
                    stacks = {**stacks, name: stack.at[index].set(written)}
                keys, values = (
                    read[name].reshape(rows, -1, k.shape[2], self.head_dim).astype(q.dtype)
                    for name in ("k", "v")
                )  # (rows, length or length + n, kv_heads, head_dim)
                return sk.attend(q, keys, values, ring.mask), stacks

            return attend

        def layer_step(carry, inputs):
            x, stacks = carry
            layer, group, index, data = inputs

            def attend(q, k, v, keep=None):
                """Each group's stacks pass through a ``cond`` of their own (taken by this
                layer's group, else handed on untouched), so no group's cache is copied."""
                del keep  # no dropout in decoding
                if len(groups) == 1:
                    out, written = group_attention(0, q, k, v, index)(stacks[0])
                    return Attended(out, (written,))
                out, written = jnp.zeros_like(q), []
                for g in range(len(groups)):

                    def untouched(group_stacks):
                        return jnp.zeros_like(q), group_stacks

                    taken = group_attention(g, q, k, v, index)
                    part, group_stacks = jax.lax.cond(group == g, taken, untouched, stacks[g])
                    out, written = out + part, [*written, group_stacks]
                return Attended(out, tuple(written))

            layer_inputs = LayerInputs(attend, features, None, data)
            out = sk.layer(layer, x, layer_inputs, sk.settings)
            return (out.stream, out.cache), None

        places = (*_layer_places(groups, self.num_layers), sk.per_layer.data(self.num_layers))
        stacks = tuple({"k": cache[g.name]["k"], "v": cache[g.name]["v"]} for g in groups)
        start = 0
        for run in layer_runs(weights.layers):  # each run of one layer type its own scan
            stop = start + run_length(run)
            per_layer = (run, *layer_slice(places, start, stop))
            (x, stacks), _ = jax.lax.scan(layer_step, (x, stacks), per_layer)
            start = stop
        written = {g.name: {**stacks[i], "positions": rings[i].after} for i, g in enumerate(groups)}
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # (rows, 1, n_embd)
        return head(weights, last, sk)[:, 0], written  # (rows, vocab)


def _layer_places(groups: tuple[CacheGroup, ...], num_layers: int) -> tuple[jax.Array, jax.Array]:
    """Each layer's group and its index within the group: int32 (n_layer,) each."""
    group_of, index_in_group = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for i, layer in enumerate(group.layers):
            group_of[layer], index_in_group[layer] = g, i
    return jnp.array(group_of, jnp.int32), jnp.array(index_in_group, jnp.int32)
