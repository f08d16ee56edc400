"""The forward pass every decoder family shares, in training and in KV-cache decoding.

A family describes its decoder with a :class:`Skeleton`: how tokens at positions become the
float32 residual stream (``embed``), what each layer reads besides its weights that depends only
on positions (``features``: rotary angles), and one layer (``layer``); its model gives its
parameters as typed :class:`Weights` (the token table, the stacked layers of the family's layer
type, the final norm, the head). :func:`run` runs it for training (layers through
:func:`theseus.scan_layers`), :class:`CachedDecoder` for ``theseus generate``; a layer calls
``inputs.attend(q, k, v)``, which attends within the sequence in training and writes the keys and
values into the cache and attends over it in decoding, so each layer is written once; it returns
what it wrote (:class:`Attended`), and the layer returns that with its new stream
(:class:`LayerOutput`). What differs between layers besides their weights (:class:`LayerData`:
the attention window, the rotary frequencies) travels through the layer scan as data, so layers
that slide and layers that read the whole context, with their own rotary bases, stay one scan.

In decoding, the layers of one window share a cache (:mod:`theseus.model.kv_cache`): full-context
layers keep every position, sliding layers a ring of their window (position ``p`` in slot ``p mod
window``), and each group keeps the position of every slot as data, so the attention mask reads
real key positions and an empty slot sits at ``EMPTY``, later than any query.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from theseus.model.attention import (
    NO_WINDOW,
    AttentionMask,
    AttentionOptions,
    attention,
    soft_cap,
)
from theseus.model.decode import ROWS, CacheArray
from theseus.model.family import Context
from theseus.model.kv_cache import EMPTY, CacheGroup, Ring, cache_groups
from theseus.model.layers import dense, dropout, fold_in
from theseus.model.lora import LoraSpec, add_adapters
from theseus.model.parts import Norm, arrays, weights
from theseus.sharding.layer_scan import scan_layers


@weights
class Weights:
    """A decoder's parameters, typed: the token ``table`` (vocab, n_embd), the ``layers`` (the
    family's layer type, each leaf stacked along ``n_layer``), the ``final_norm``, the output
    ``head`` (vocab, n_embd) (None: the table, a tied head) and, for learned positions, their
    table ``positions`` (context, n_embd)."""

    table: Any
    layers: Any
    final_norm: Norm
    head: Any = None
    positions: Any = None


@weights
class LayerData:
    """What differs between layers besides their weights, layer-indexed so it travels through
    the layer scan: each layer's attention ``window`` int32 (n_layer,) (:data:`NO_WINDOW`: the
    whole context) and rotary ``inv_freq`` float32 (n_layer, head_dim / 2) (None: the layers
    share the skeleton's features)."""

    window: Any
    inv_freq: Any = None


@dataclass(frozen=True)
class PerLayer:
    """:class:`LayerData` as plain values for a skeleton: each layer's ``windows`` (None: the
    whole context; empty: no layer slides) and ``inv_freqs`` (empty: none per layer)."""

    windows: tuple[int | None, ...] = ()
    inv_freqs: tuple[tuple[float, ...], ...] = ()

    def data(self, num_layers: int) -> LayerData:
        """The values as layer-indexed arrays."""
        windows = self.windows or (None,) * num_layers
        assert len(windows) == num_layers, (windows, num_layers)
        window = jnp.array([NO_WINDOW if w is None else w for w in windows], jnp.int32)
        inv_freq = jnp.array(self.inv_freqs, jnp.float32) if self.inv_freqs else None
        return LayerData(window=window, inv_freq=inv_freq)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Attended:
    """What a layer's attention gives: its ``output`` (``attend``: heads (batch, seq, heads,
    head_dim); a family's helper may return its projection instead) and the decoding ``cache``
    with this layer's keys and values written (None in training), which the layer returns."""

    output: jax.Array
    cache: Any = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerOutput:
    """What a layer returns: the new float32 ``stream`` (batch, seq, n_embd), the ``cache``
    its attention returned (:attr:`Attended.cache`) and, for an expert layer, its ``routing``
    (:class:`theseus.model.experts.Routing`; None: the layer routes nothing)."""

    stream: jax.Array
    cache: Any = None
    routing: Any = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Outputs:
    """What a forward pass gives: float32 ``logits`` (batch, seq, vocab) and the routing
    statistics its expert layers added up (:class:`theseus.model.experts.RouterSums`; None for
    a model without experts)."""

    logits: jax.Array
    routing: Any = None


@dataclass(frozen=True)
class LayerInputs:
    """What one layer reads besides its weights and the residual stream: ``attend(q, k, v,
    keep=None)`` (heads (batch, seq, heads, head_dim) in, an :class:`Attended` of the same
    shape out), the position ``features``, the layer's per-example dropout ``keys`` (None: no
    dropout) and its :class:`LayerData` ``data``."""

    attend: Callable[..., Attended]
    features: Any
    keys: jax.Array | None
    data: LayerData


def no_features(positions: jax.Array, settings: Any) -> None:
    """The features of layers that read no positions (they are in the embedding: GPT)."""
    del positions, settings


def no_routing(settings: Any) -> None:
    """The routing statistics of a model without experts: none."""
    del settings


@dataclass(frozen=True)
class Skeleton:
    """A family's decoder as plain, hashable values (it becomes part of a model's graphdef).

    ``embed(weights, tokens, positions, settings)`` gives the float32 stream (batch, seq,
    n_embd) of ``tokens`` at ``positions`` (batch or 1, seq); ``layer(weights, x, inputs,
    settings)`` one layer's :class:`LayerOutput` from its typed weights; ``features(positions,
    settings)`` what every layer reads of the positions (default: nothing). ``settings`` holds
    the family's own constants (a frozen dataclass); ``context`` the longest sequence and the
    config key that sets it. ``per_layer``: each layer's window and rotary frequencies;
    ``attention``: how every layer attends besides its mask (:class:`AttentionOptions`);
    ``logit_softcap`` caps the logits at ``±cap`` with ``cap · tanh(x / cap)`` (None: uncapped).
    ``routing(settings)``: the empty routing statistics the expert layers add to (None: no
    experts).
    """

    embed: Callable[[Weights, jax.Array, jax.Array, Any], jax.Array]
    layer: Callable[[Any, jax.Array, LayerInputs, Any], LayerOutput]
    settings: Any
    compute_dtype: jnp.dtype
    context: Context
    features: Callable[[jax.Array, Any], Any] = no_features
    dropout: float = 0.0
    remat: bool | str = False
    per_layer: PerLayer = PerLayer()
    attention: AttentionOptions = AttentionOptions()
    logit_softcap: float | None = None
    routing: Callable[[Any], Any] = no_routing

    def attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, **dropout: Any
    ) -> jax.Array:
        """:func:`attention` with the skeleton's attention options, its windows the
        skeleton's."""
        options = replace(self.attention, windows=self.distinct_windows())
        return attention(q, k, v, mask, **options.keywords(), **dropout)

    def distinct_windows(self) -> tuple[int | None, ...]:
        """The windows the layers have, each once (None: the whole context), in layer order."""
        return tuple(dict.fromkeys(self.per_layer.windows or (None,)))

    def check_length(self, seq: int) -> None:
        if seq > self.context.length:
            raise ValueError(
                f"sequence length {seq} exceeds the model's context of {self.context.length} "
                f"positions ({self.context.key})."
            )


class DecoderModel(nnx.Module):
    """A family's model: ``build(config, rngs)`` creates its parameters (the subclass's, typed
    weights held with ``nnx.data``), ``weights()`` gives them as :class:`Weights`,
    ``skeleton_of(config, compute_dtype, remat)`` describes its forward pass. LoRA adapters are
    added after the base weights, which keep their random streams.

    Parameters are float32; matmuls run in ``compute_dtype`` while norms' statistics, softmax,
    the residual stream and the logits stay float32. ``remat`` says what each layer recomputes
    in the backward pass (see :func:`theseus.scan_layers`).
    """

    skeleton_of: Callable[..., Skeleton]

    def __init__(
        self,
        config: Any,
        *,
        rngs: nnx.Rngs,
        compute_dtype: DTypeLike = jnp.float32,
        remat: bool | str = False,
        lora: LoraSpec | None = None,
    ):
        self.skeleton = type(self).skeleton_of(config, compute_dtype, remat)
        self.build(config, rngs)
        if lora is not None:
            add_adapters(self, lora, rngs=rngs)

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        """Create the family's parameters (each family's model defines it; an abstract method,
        without ``abc`` because nnx modules have their own metaclass)."""
        raise NotImplementedError(f"{type(self).__name__} must define build(config, rngs)")

    def weights(self) -> Weights:
        """The parameters as :class:`Weights` (with ``nnx.Param`` leaves; see
        :func:`~theseus.model.parts.arrays`); each family's model defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define weights()")

    def __call__(
        self,
        tokens: jax.Array,
        keys: jax.Array | None = None,
        *,
        deterministic: bool = True,
        segments: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Float32 logits ``(batch, seq, vocab)`` of int ``tokens`` ``(batch, seq)`` (the
        logits of :meth:`outputs`)."""
        return self.outputs(
            tokens, keys, deterministic=deterministic, segments=segments, positions=positions
        ).logits

    def outputs(
        self,
        tokens: jax.Array,
        keys: jax.Array | None = None,
        *,
        deterministic: bool = True,
        segments: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> Outputs:
        """The :class:`Outputs` of int ``tokens`` ``(batch, seq)``.

        ``deterministic=False`` (training) applies dropout (when the model has any) with the
        per-example ``keys`` ``(batch,)``, which it then needs. Packed rows give ``segments``
        (batch, seq), a query reading keys of its own segment only, and ``positions`` (batch,
        seq), which restart in each segment (default: 0, 1, ... along the row)."""
        rate = self.skeleton.dropout
        if deterministic or rate == 0.0:
            keys = None
        elif keys is None:
            raise ValueError(
                f"{type(self).__name__} with dropout {rate} called with deterministic=False "
                "needs one key per example: pass keys (batch,), e.g. Keys.examples in a "
                "trainer's loss"
            )
        w = arrays(self.weights())
        return run(w, tokens, self.skeleton, keys, segments=segments, positions=positions)


def run(
    weights: Weights,
    tokens: jax.Array,
    skeleton: Skeleton,
    keys: jax.Array | None = None,
    *,
    segments: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> Outputs:
    """The :class:`Outputs` of int ``tokens`` (batch, seq) from ``weights``; with per-example
    ``keys`` (batch,), dropout at ``skeleton.dropout`` (embedding: stream 0, layer ``i``: stream
    ``i + 1``); with ``segments`` and ``positions`` (batch, seq), attention within each segment
    and positions as given (packed rows). The routing statistics leave padding (segment 0) out."""
    sk = skeleton
    seq = tokens.shape[1]
    sk.check_length(seq)
    if positions is None:
        positions = jnp.arange(seq)[None]  # (1, seq)
    x = sk.embed(weights, tokens, positions, sk.settings)  # (batch, seq, n_embd) float32
    x = dropout(x, sk.dropout, fold_in(keys, 0))
    features = sk.features(positions, sk.settings)
    mask = AttentionMask(positions, positions, segments, segments)

    counted = None if segments is None else (segments != 0).reshape(-1).astype(jnp.float32)

    def one_layer(inputs, carry):
        (layer, index, data), (x, routing) = inputs, carry
        layer_mask = replace(mask, window=data.window)

        def attend(q, k, v, keep=None):
            return Attended(sk.attend(q, k, v, layer_mask, dropout_rate=sk.dropout, keep=keep))

        layer_inputs = LayerInputs(attend, features, fold_in(keys, index + 1), data)
        out = sk.layer(layer, x, layer_inputs, sk.settings)
        routed = out.routing is not None
        return out.stream, routing.add(out.routing, counted) if routed else routing

    num_layers = jax.tree.leaves(weights.layers)[0].shape[0]  # leaves (n_layer, ...)
    per_layer = (weights.layers, jnp.arange(num_layers), sk.per_layer.data(num_layers))
    carry = (x, sk.routing(sk.settings))
    x, routing = scan_layers(one_layer, carry, per_layer, remat=sk.remat)
    return Outputs(head(weights, x, sk), routing)


def head(weights: Weights, x: jax.Array, skeleton: Skeleton) -> jax.Array:
    """Logits (batch, seq, vocab) float32 of the stream ``x``: the final norm, then the head;
    soft-capped when the skeleton says."""
    h = weights.final_norm(x, skeleton.compute_dtype)  # (batch, seq, n_embd)
    table = weights.table if weights.head is None else weights.head  # (vocab, n_embd)
    logits = dense(h, table, jnp.float32, transposed=True)  # (batch, seq, vocab)
    return soft_cap(logits, skeleton.logit_softcap)


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

        group_of, index_in_group = _layer_places(groups, self.num_layers)
        stacks = tuple({"k": cache[g.name]["k"], "v": cache[g.name]["v"]} for g in groups)
        data = sk.per_layer.data(self.num_layers)
        per_layer = (weights.layers, group_of, index_in_group, data)
        (x, stacks), _ = jax.lax.scan(layer_step, (x, stacks), per_layer)
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
