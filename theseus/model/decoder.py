"""The forward pass every decoder family shares, in training and in KV-cache decoding.

A family describes its decoder with a :class:`Skeleton`: how tokens at positions become the
float32 residual stream (``embed``), what each layer reads besides its weights that depends only
on positions (``features``: rotary angles), one layer (``layer``), and the parameter paths of the
token table, the stacked layers, the final norm and the untied head. :func:`forward` runs it for
training (layers through :func:`theseus.scan_layers`), :class:`CachedDecoder` for ``theseus
generate``; a layer calls ``inputs.attend(q, k, v)``, which attends within the sequence in
training and writes the keys and values into the cache and attends over it in decoding, so each
layer is written once. Each layer's attention window (``Skeleton.windows``) and rotary frequencies
(``Skeleton.inv_freqs``) travel through the layer scan as data, so layers that slide and layers
that read the whole context, with their own rotary bases, stay one scan.
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
from theseus.model.layers import dense, dropout, fold_in
from theseus.model.lora import LoraSpec, add_adapters, scaled
from theseus.model.parts import norm
from theseus.sharding.layer_scan import scan_layers


@dataclass(frozen=True)
class LayerInputs:
    """What one layer reads besides its weights and the residual stream: ``attend(q, k, v,
    keep=None)`` (heads (batch, seq, heads, head_dim) in, the same shape out), the position
    ``features``, the layer's per-example dropout ``keys`` (None: no dropout) and its rotary
    inverse frequencies ``inv_freq`` (head_dim / 2,) (None: the skeleton has no per-layer ones)."""

    attend: Callable[..., jax.Array]
    features: Any
    keys: jax.Array | None
    inv_freq: jax.Array | None = None


@dataclass(frozen=True)
class Paths:
    """Where a family keeps its parameters: the token table, the stacked layers, the final norm
    and the output head (used when present, else the token table: a tied head)."""

    embed: str
    layers: str
    final_norm: str
    head: str


@dataclass(frozen=True)
class Skeleton:
    """A family's decoder as plain, hashable values (it becomes part of a model's graphdef).

    ``embed(params, tokens, positions, settings)`` gives the float32 stream (batch, seq, n_embd)
    of ``tokens`` at ``positions`` (batch or 1, seq); ``features(positions, settings)`` what every
    layer reads of the positions; ``layer(weights, x, inputs, settings)`` one layer's new stream.
    ``settings`` holds the family's own constants (a frozen dataclass). ``windows``: each
    layer's sliding attention window (None: the layer reads the whole context; empty: no layer
    slides). ``inv_freqs``: each layer's rotary inverse frequencies (empty: none per layer).
    ``attention``: how every layer attends besides its mask (scale, soft cap: see
    :class:`AttentionOptions`); ``logit_softcap`` caps the logits at ``±cap`` with
    ``cap · tanh(x / cap)`` (None: uncapped). ``final_norm(x, params, eps, dtype)``: the norm
    before the head.
    """

    embed: Callable[[dict, jax.Array, jax.Array, Any], jax.Array]
    features: Callable[[jax.Array, Any], Any]
    layer: Callable[[dict, jax.Array, LayerInputs, Any], jax.Array]
    settings: Any
    paths: Paths
    eps: float  # of the final norm
    compute_dtype: jnp.dtype
    context_len: int
    context_key: str  # the config keys that set context_len, for the error message
    dropout: float = 0.0
    remat: bool | str = False
    lora_scale: float = 0.0  # alpha / rank of the LoRA adapters (0: none)
    windows: tuple[int | None, ...] = ()
    inv_freqs: tuple[tuple[float, ...], ...] = ()
    attention: AttentionOptions = AttentionOptions()
    logit_softcap: float | None = None
    final_norm: Callable[[jax.Array, dict, float, Any], jax.Array] = norm

    def layer_inv_freqs(self) -> jax.Array | None:
        """The rotary inverse frequencies as layer-indexed data: float32 (n_layer, head_dim / 2),
        or None when the skeleton has none per layer."""
        return jnp.array(self.inv_freqs, jnp.float32) if self.inv_freqs else None

    def attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, **dropout: Any
    ) -> jax.Array:
        """:func:`attention` with the skeleton's attention options, its windows the
        skeleton's."""
        options = replace(self.attention, windows=self.distinct_windows())
        return attention(q, k, v, mask, **options.keywords(), **dropout)

    def distinct_windows(self) -> tuple[int | None, ...]:
        """The windows the layers have, each once (None: the whole context), in layer order."""
        return tuple(dict.fromkeys(self.windows or (None,)))

    def layer_windows(self, num_layers: int) -> jax.Array:
        """The windows as layer-indexed data: int32 (n_layer,), NO_WINDOW for a whole-context
        layer."""
        windows = self.windows or (None,) * num_layers
        assert len(windows) == num_layers, (windows, num_layers)
        return jnp.array([NO_WINDOW if w is None else w for w in windows], jnp.int32)

    def check_length(self, seq: int) -> None:
        if seq > self.context_len:
            raise ValueError(
                f"sequence length {seq} exceeds the model's context of {self.context_len} "
                f"positions ({self.context_key})."
            )

    def weights(self, layer: dict) -> dict:
        """One layer's weights with its LoRA adapters scaled (applied once per layer)."""
        return scaled(layer, self.lora_scale) if self.lora_scale else layer


class DecoderModel(nnx.Module):
    """A family's model: ``build(config, rngs)`` creates its parameters (the subclass's),
    ``skeleton_of(config, compute_dtype, remat, lora_scale)`` describes its forward pass. LoRA
    adapters are added after the base weights, which keep their random streams.

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
        scale = 0.0 if lora is None else lora.scale
        self.skeleton = type(self).skeleton_of(config, compute_dtype, remat, scale)
        self.build(config, rngs)
        if lora is not None:
            add_adapters(self, lora, rngs=rngs)

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        """Create the family's parameters (each family's model defines it; an abstract method,
        without ``abc`` because nnx modules have their own metaclass)."""
        raise NotImplementedError(f"{type(self).__name__} must define build(config, rngs)")

    def __call__(
        self,
        tokens: jax.Array,
        keys: jax.Array | None = None,
        *,
        deterministic: bool = True,
        segments: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Float32 logits ``(batch, seq, vocab)`` of int ``tokens`` ``(batch, seq)``.

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
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.skeleton, keys, segments=segments, positions=positions)


def forward(
    params: dict,
    tokens: jax.Array,
    skeleton: Skeleton,
    keys: jax.Array | None = None,
    *,
    segments: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Float32 logits (batch, seq, vocab) of int ``tokens`` (batch, seq) from a parameter dict;
    with per-example ``keys`` (batch,), dropout at ``skeleton.dropout`` (embedding: stream 0,
    layer ``i``: stream ``i + 1``); with ``segments`` and ``positions`` (batch, seq), attention
    within each segment and positions as given (packed rows)."""
    sk = skeleton
    seq = tokens.shape[1]
    sk.check_length(seq)
    if positions is None:
        positions = jnp.arange(seq)[None]  # (1, seq)
    x = sk.embed(params, tokens, positions, sk.settings)  # (batch, seq, n_embd) float32
    x = dropout(x, sk.dropout, fold_in(keys, 0))
    features = sk.features(positions, sk.settings)
    mask = AttentionMask(positions, positions, segments, segments)

    def one_layer(inputs, x):
        layer, index, window, inv_freq = inputs
        layer_mask = replace(mask, window=window)

        def attend(q, k, v, keep=None):
            return sk.attend(q, k, v, layer_mask, dropout_rate=sk.dropout, keep=keep)

        layer_inputs = LayerInputs(attend, features, fold_in(keys, index + 1), inv_freq)
        return sk.layer(sk.weights(layer), x, layer_inputs, sk.settings)

    layers = params[sk.paths.layers]  # arrays of shape (n_layer, ...)
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    windows, inv_freqs = sk.layer_windows(num_layers), sk.layer_inv_freqs()
    per_layer = (layers, jnp.arange(num_layers), windows, inv_freqs)
    x = scan_layers(one_layer, x, per_layer, remat=sk.remat)
    return head(params, x, sk)


def head(params: dict, x: jax.Array, skeleton: Skeleton) -> jax.Array:
    """Logits (batch, seq, vocab) float32 of the stream ``x``: the final norm, then the untied
    head when the parameters have one, else the token table; soft-capped when the skeleton says."""
    paths = skeleton.paths
    h = skeleton.final_norm(x, params[paths.final_norm], skeleton.eps, skeleton.compute_dtype)
    table = params.get(paths.head, params[paths.embed])  # (vocab, n_embd)
    return soft_cap(dense(h, table, jnp.float32, transposed=True), skeleton.logit_softcap)


@dataclass(frozen=True)
class CachedDecoder:
    """A family's decoder with a cache of keys and values (:class:`theseus.model.decode.Decoder`):
    ``k`` and ``v`` of shape (n_layer, rows, cache_len, kv_width) in the compute dtype, named
    (``n_layer``, rows, ``names[0]``, ``names[1]``): rows over ``batch``, the key/value heads
    as the family's plan splits their projections in training."""

    skeleton: Skeleton
    vocab_size: int
    num_layers: int
    head_dim: int
    kv_width: int
    names: tuple[str | None, str]

    @property
    def context_len(self) -> int:
        return self.skeleton.context_len

    def cache(self, num_rows: int, cache_len: int) -> dict[str, CacheArray]:
        shape = (self.num_layers, num_rows, cache_len, self.kv_width)
        names = ("n_layer", ROWS, *self.names)
        dtype = self.skeleton.compute_dtype
        return {name: CacheArray(shape, dtype, names) for name in ("k", "v")}

    def __call__(
        self, params: Any, cache: dict[str, jax.Array], tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        sk = self.skeleton
        rows, num_new = tokens.shape
        query_positions = positions[:, None] + jnp.arange(num_new)  # (rows, n)
        x = sk.embed(params, tokens, query_positions, sk.settings)  # (rows, n, n_embd)
        features = sk.features(query_positions, sk.settings)
        cache_len = cache["k"].shape[2]
        mask = AttentionMask.cached(query_positions, cache_len)

        def layer_step(x, inputs):
            layer, k_cache, v_cache, window, inv_freq = inputs  # caches (rows, cache_len, kv)
            layer_mask = replace(mask, window=window)
            written = []

            def attend(q, k, v, keep=None):
                del keep  # no dropout in decoding
                new = [
                    _write(c, t.reshape(rows, num_new, -1), positions)
                    for c, t in ((k_cache, k), (v_cache, v))
                ]
                written.extend(new)
                keys, values = (c.reshape(rows, cache_len, -1, self.head_dim) for c in new)
                return sk.attend(q, keys.astype(q.dtype), values.astype(q.dtype), layer_mask)

            layer_inputs = LayerInputs(attend, features, None, inv_freq)
            x = sk.layer(sk.weights(layer), x, layer_inputs, sk.settings)
            return x, tuple(written)

        windows, inv_freqs = sk.layer_windows(self.num_layers), sk.layer_inv_freqs()
        layers = (params[sk.paths.layers], cache["k"], cache["v"], windows, inv_freqs)
        x, (k, v) = jax.lax.scan(layer_step, x, layers)
        return head(params, x, sk), {"k": k, "v": v}  # (rows, n, vocab)


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """``cache`` (rows, cache_len, width) with ``new`` (rows, n, width) written at rows'
    ``positions`` (rows,) onwards."""
    new = new.astype(cache.dtype)
    return jax.vmap(lambda c, u, p: jax.lax.dynamic_update_slice(c, u, (p, 0)))(
        cache, new, positions
    )
