"""The forward pass every decoder family shares, in training and in KV-cache decoding.

A family describes its decoder with a :class:`Skeleton`: how tokens at positions become the
float32 residual stream (``embed``), what each layer reads besides its weights that depends only
on positions (``features``: rotary angles), and one layer (``layer``); its model gives its
parameters as typed :class:`Weights` (the token table, the stacked layers of the family's layer
type, the final norm, the head). :func:`stream` runs it for training (layers through
:func:`theseus.scan_layers`), then :func:`head` gives logits or, for a loss,
:func:`theseus.model.head.chunked_scores` the targets' log-probabilities a chunk at a time;
:class:`~theseus.model.cached_decoder.CachedDecoder` runs it for ``theseus generate``. A layer
calls ``inputs.attend(q, k, v)``, which attends within the sequence in training and writes the
keys and values into the cache and attends over it in decoding, so each layer is written once; it
returns what it wrote (:class:`Attended`), and the layer returns that with its new stream
(:class:`LayerOutput`). What differs between layers besides their weights (:class:`LayerData`:
the attention window, the rotary frequencies) travels through the layer scan as data, so layers
that slide and layers that read the whole context, with their own rotary bases, stay one scan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from theseus.model.attention import NO_WINDOW, AttentionMask, AttentionOptions, attention
from theseus.model.family import Context
from theseus.model.head import (
    ScoredTargets,
    chunked_scores,
    logits,
    sampled_at,
    scores_of_logits,
    target_logps_of,
)
from theseus.model.layers import dropout, fold_in
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
class Runs:
    """A decoder's layers in runs of consecutive layers of one type (a model whose layers are
    not all alike: Qwen3-MoE's dense layers between expert layers): ``runs`` maps each run's
    index (``"0"``, ``"1"``, ...) to its layers, stacked along ``n_layer``; each run is one
    layer scan. A model whose layers are all alike holds its stacked layer type itself."""

    runs: dict[str, Any]


def stack_runs(runs: list[Any]) -> Any:
    """A decoder's ``layers`` from its runs (each a stacked layer type), in layer order: the
    one run itself, else :class:`Runs`."""
    return runs[0] if len(runs) == 1 else Runs(runs={str(i): run for i, run in enumerate(runs)})


def layer_runs(layers: Any) -> tuple[Any, ...]:
    """The runs of a decoder's ``layers`` (:class:`Runs`, or one stacked layer type: one run),
    in layer order."""
    if isinstance(layers, Runs):
        return tuple(layers.runs[str(i)] for i in range(len(layers.runs)))
    return (layers,)


def run_length(run: Any) -> int:
    """The number of layers of a run (its leaves are stacked along ``n_layer``)."""
    return jax.tree.leaves(run)[0].shape[0]


def layer_slice(tree: Any, start: int, stop: int) -> Any:
    """Layers ``[start, stop)`` of a layer-indexed ``tree`` (leaves (n_layer, ...))."""
    return jax.tree.map(lambda a: a[start:stop], tree)


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


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TargetLogps:
    """What a forward pass scored against targets gives: float32 ``logps`` (batch, seq), each
    target's log-probability (in chunks: :func:`chunked_scores`), the routing statistics as in
    :class:`Outputs`, and each position's ``entropies`` (:meth:`DecoderModel.sampled_logps`)."""

    logps: jax.Array
    routing: Any = None
    entropies: jax.Array | None = None


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
        w, keys = arrays(self.weights()), self.dropout_keys(keys, deterministic)
        return run(w, tokens, self.skeleton, keys, segments=segments, positions=positions)

    def target_logps(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        keys: jax.Array | None = None,
        *,
        chunk: int,
        deterministic: bool = True,
        segments: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> TargetLogps:
        """The :class:`TargetLogps` of int ``tokens`` against int ``targets`` (both (batch,
        seq); the other arguments as :meth:`outputs` reads them): the head and the loss run
        ``chunk`` positions at a time, so no logits (batch, seq, vocab) exist."""
        keys = self.dropout_keys(keys, deterministic)
        logps, routing = self._scored(
            target_logps_of, tokens, targets, keys, chunk, segments, positions
        )
        return TargetLogps(logps, routing)

    def sampled_logps(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        keys: jax.Array | None = None,
        *,
        chunk: int,
        temperature: float,
        deterministic: bool = True,
        segments: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> TargetLogps:
        """:meth:`target_logps` at ``temperature`` (RL's), with each position's entropy."""
        keys = self.dropout_keys(keys, deterministic)
        score = sampled_at(temperature)
        scored, routing = self._scored(score, tokens, targets, keys, chunk, segments, positions)
        return TargetLogps(scored.logps, routing, scored.entropies)

    def scored_targets(self, tokens: jax.Array, targets: jax.Array, *, chunk: int) -> ScoredTargets:
        """Each target's log-probability and greedy flag of ``tokens`` against ``targets``
        (both (batch, seq)), without dropout, ``chunk`` positions at a time: task scoring's."""
        return self._scored(scores_of_logits, tokens, targets, None, chunk, None, None)[0]

    def _scored(
        self,
        score: Callable[[jax.Array, jax.Array], Any],
        tokens: jax.Array,
        targets: jax.Array,
        keys: jax.Array | None,
        chunk: int,
        segments: jax.Array | None,
        positions: jax.Array | None,
    ) -> tuple[Any, Any]:
        """``score`` of each chunk's logits (:func:`chunked_scores`), and the routing stats."""
        w, sk = arrays(self.weights()), self.skeleton
        x, routing = stream(w, tokens, sk, keys, segments=segments, positions=positions)
        table = w.table if w.head is None else w.head  # (vocab, n_embd)
        args = (w.final_norm, table, x, targets, sk.compute_dtype, sk.logit_softcap, chunk)
        return chunked_scores(score, *args), routing

    def dropout_keys(self, keys: jax.Array | None, deterministic: bool) -> jax.Array | None:
        """The per-example dropout ``keys`` a pass uses (None: ``deterministic``, or none)."""
        rate = self.skeleton.dropout
        if deterministic or rate == 0.0:
            return None
        if keys is None:
            raise ValueError(
                f"{type(self).__name__} with dropout {rate} called with deterministic=False "
                "needs one key per example: pass keys (batch,), e.g. Keys.examples in a "
                "trainer's loss"
            )
        return keys


def stream(
    weights: Weights,
    tokens: jax.Array,
    skeleton: Skeleton,
    keys: jax.Array | None = None,
    *,
    segments: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """The float32 stream (batch, seq, n_embd) after the last layer, before the final norm, of
    int ``tokens`` (batch, seq) from ``weights``, and the routing statistics; with per-example
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

    runs = layer_runs(weights.layers)
    data = sk.per_layer.data(sum(run_length(run) for run in runs))
    carry, start = (x, sk.routing(sk.settings)), 0
    for run in runs:  # each run of one layer type its own scan, in layer order
        stop = start + run_length(run)
        per_layer = (run, jnp.arange(start, stop), layer_slice(data, start, stop))
        carry, start = scan_layers(one_layer, carry, per_layer, remat=sk.remat), stop
    return carry


def run(
    weights: Weights,
    tokens: jax.Array,
    skeleton: Skeleton,
    keys: jax.Array | None = None,
    *,
    segments: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> Outputs:
    """The :class:`Outputs` of int ``tokens`` (batch, seq): :func:`stream`, then :func:`head`."""
    x, routing = stream(weights, tokens, skeleton, keys, segments=segments, positions=positions)
    return Outputs(head(weights, x, skeleton), routing)


def head(weights: Weights, x: jax.Array, skeleton: Skeleton) -> jax.Array:
    """Logits (batch, seq, vocab) float32 of the stream ``x``: the final norm, then the head;
    soft-capped when the skeleton says."""
    table = weights.table if weights.head is None else weights.head  # (vocab, n_embd)
    return logits(weights.final_norm, table, x, skeleton.compute_dtype, skeleton.logit_softcap)
