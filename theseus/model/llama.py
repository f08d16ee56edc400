"""The Llama family in Flax NNX: Llama 2/3/3.1/3.2, Mistral-style, Qwen2/2.5 and Qwen3 decoders.

One configurable decoder: RMSNorm, rotary embeddings (``rope_theta``, optionally Llama 3.1's
frequency-dependent scaling), grouped-query attention through ``jax.nn.dot_product_attention``,
a SwiGLU MLP, a tied or untied output head, optional q/k/v biases (Qwen2) and optional per-head
q/k RMSNorm with a ``head_dim`` independent of ``hidden_size / num_heads`` (Qwen3).

Weights are stored as Hugging Face stores them, ``(d_out, d_in)`` per layer, stacked along a
leading ``n_layer`` dimension, and q/k keep Hugging Face's head layout (rotary embeddings rotate
the two halves of each head), so checkpoints import and export without permuting anything. Every
weight is one float32 ``nnx.Param`` with logical names; :data:`LLAMA_PLAN` is the model's plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.config import Section
from theseus.model.layers import dense
from theseus.model.lora import LoraSpec, adapter_out, add_adapters, scaled
from theseus.sharding.axis import Axis, ShardingPlan
from theseus.sharding.layer_scan import scan_layers

# TP splits the query heads (n_q = num_heads × head_dim), the key/value heads (n_kv) and the MLP
# over `shard`; the residual width, vocabulary and layer count stay whole on each TP device.
# Heads are contiguous slices of n_q and n_kv, so each device holds whole heads when tp divides
# num_kv_heads (results are correct for any tp that divides the widths). ZeRO also partitions
# the vocabulary (embedding and head) over `batch`.
LLAMA_PLAN = ShardingPlan(
    tp=[
        ("n_q", Axis.SHARD),
        ("n_kv", Axis.SHARD),
        ("n_mlp", Axis.SHARD),
        ("vocab", None),
        ("n_embd", None),
        ("n_layer", None),
    ],
    zero=[
        ("n_q", Axis.BATCH),
        ("n_kv", Axis.BATCH),
        ("n_mlp", Axis.BATCH),
        ("vocab", Axis.BATCH),
    ],
)

Names = tuple[str | None, ...]


class LlamaConfig(Section):
    """Hyperparameters of a Llama-family decoder (the names of Hugging Face's configs).

    Attributes:
        vocab_size: token ids (rows of the embedding and of the output head).
        hidden_size: width of the residual stream.
        intermediate_size: hidden width of the SwiGLU MLP.
        num_layers: decoder layers.
        num_heads: query heads; num_kv_heads: key/value heads (grouped-query attention), a
            divisor of num_heads.
        head_dim: width of one head; None means hidden_size / num_heads (Qwen3 sets its own).
        max_position_embeddings: the context length (default training sequence length and the
            longest generation).
        rope_theta: base of the rotary frequencies; rope_type ``llama3`` scales them as Llama
            3.1 does with rope_factor, rope_low_freq_factor, rope_high_freq_factor and
            rope_original_max_position_embeddings.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: the output head is the embedding table.
        attention_bias: q, k and v projections have biases (Qwen2).
        qk_norm: RMSNorm over each head of q and k before the rotary embedding (Qwen3).
        sliding_window: Mistral's attention window, carried from an import. theseus attends the
            full context, which equals the window's attention only up to the window's length,
            so longer sequences are refused (see ``context_len``); None: no window.
    """

    vocab_size: pydantic.StrictInt = pydantic.Field(256, gt=0, description="token ids")
    hidden_size: pydantic.StrictInt = pydantic.Field(128, gt=0, description="residual width")
    intermediate_size: pydantic.StrictInt = pydantic.Field(352, gt=0, description="MLP width")
    num_layers: pydantic.StrictInt = pydantic.Field(4, gt=0, description="decoder layers")
    num_heads: pydantic.StrictInt = pydantic.Field(4, gt=0, description="query heads")
    num_kv_heads: pydantic.StrictInt = pydantic.Field(2, gt=0, description="key/value heads")
    head_dim: pydantic.StrictInt | None = pydantic.Field(
        None, gt=0, description="head width; None: hidden_size / num_heads"
    )
    max_position_embeddings: pydantic.StrictInt = pydantic.Field(
        128, gt=0, description="context length"
    )
    rope_theta: float = pydantic.Field(10000.0, gt=0, description="rotary base")
    rope_type: Literal["default", "llama3"] = pydantic.Field(
        "default", description="rotary frequencies: plain, or Llama 3.1's scaling"
    )
    rope_factor: float = pydantic.Field(8.0, gt=0, description="llama3: scaling factor")
    rope_low_freq_factor: float = pydantic.Field(1.0, gt=0, description="llama3: low factor")
    rope_high_freq_factor: float = pydantic.Field(4.0, gt=0, description="llama3: high factor")
    rope_original_max_position_embeddings: pydantic.StrictInt = pydantic.Field(
        8192, gt=0, description="llama3: original context length"
    )
    rms_norm_eps: float = pydantic.Field(1e-6, gt=0, description="RMSNorm epsilon")
    tie_word_embeddings: bool = pydantic.Field(False, description="output head = embedding")
    attention_bias: bool = pydantic.Field(False, description="q/k/v projection biases")
    qk_norm: bool = pydantic.Field(False, description="per-head q/k RMSNorm")
    sliding_window: pydantic.StrictInt | None = pydantic.Field(
        None, gt=0, description="Mistral's attention window (longer sequences refused)"
    )

    @pydantic.model_validator(mode="after")
    def _heads_fit(self) -> LlamaConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; set head_dim."
            )
        if self.dim_per_head % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.dim_per_head} must be even (rotary).")
        return self

    @property
    def context_len(self) -> int:
        """The longest sequence computed exactly: the context, or the sliding window if smaller."""
        return min(
            self.max_position_embeddings, self.sliding_window or self.max_position_embeddings
        )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def n_q(self) -> int:
        """Width of the query projection (all heads)."""
        return self.num_heads * self.dim_per_head

    @property
    def n_kv(self) -> int:
        """Width of the key and of the value projection (all key/value heads)."""
        return self.num_kv_heads * self.dim_per_head


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """Rotary inverse frequencies ``(head_dim / 2,)`` float32, as transformers computes them
    (``rope_type`` default or llama3)."""
    dim = config.dim_per_head
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponents)).astype(np.float32)
    if config.rope_type == "default":
        return inv
    old_len = config.rope_original_max_position_embeddings
    low_wavelen = old_len / config.rope_low_freq_factor
    high_wavelen = old_len / config.rope_high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / config.rope_factor, inv)
    smooth = (old_len / wavelen - config.rope_low_freq_factor) / (
        config.rope_high_freq_factor - config.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / config.rope_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``(..., head_dim)`` float32 of integer ``positions`` (...)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # (..., dim / 2)
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # (..., head_dim)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate heads ``x`` (batch, seq, heads, head_dim) by ``cos``/``sin`` (batch, seq, head_dim)
    in float32, Hugging Face's layout (the first half of a head pairs with the second)."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)  # (batch, seq, heads, head_dim)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype: DTypeLike) -> jax.Array:
    """RMSNorm over the last axis with float32 statistics; the result is cast to ``dtype``."""
    x = x.astype(jnp.float32)  # (..., dim)
    variance = jnp.square(x).mean(axis=-1, keepdims=True)  # (..., 1)
    return (weight * (x * jax.lax.rsqrt(variance + eps))).astype(dtype)


def project(x: jax.Array, proj: dict) -> jax.Array:
    """``x @ weight.T (+ bias)`` in ``x.dtype`` for a ``(d_out, d_in)`` weight; a bias, and LoRA
    adapters' share when the projection has them, are added in float32 before the one rounding."""
    if "bias" not in proj and "lora_a" not in proj:
        return dense(x, proj["weight"], transposed=True)
    out = dense(x, proj["weight"], jnp.float32, transposed=True)  # (.., d_out)
    if "lora_a" in proj:
        out = out + adapter_out(x, proj, transposed=True)
    return (out + proj["bias"] if "bias" in proj else out).astype(x.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: Names, init) -> nnx.Param:
    """A float32 parameter with logical ``names`` (never applied eagerly by flax)."""
    init = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), eager_sharding=False)


class Proj(nnx.Module):
    """A stacked projection: ``weight`` (n_layer, d_out, d_in) and optionally ``bias``
    (n_layer, d_out); LoRA may adapt its weight (:mod:`theseus.model.lora`)."""

    lora_weight = "weight"
    lora_layout = "oi"

    def __init__(self, num_layers, d_out, d_in, names, *, bias: bool, rngs: nnx.Rngs):
        out_name = names[0]
        normal = nnx.initializers.normal(0.02)
        self.weight = _param(rngs, (num_layers, d_out, d_in), ("n_layer", *names), normal)
        if bias:
            zeros = nnx.initializers.zeros
            self.bias = _param(rngs, (num_layers, d_out), ("n_layer", out_name), zeros)


class Norm(nnx.Module):
    """An RMSNorm weight ``(dim,)``, or ``(n_layer, dim)`` when stacked; replicated."""

    def __init__(self, dim: int, *, num_layers: int | None = None, rngs: nnx.Rngs):
        shape, names = (
            ((dim,), (None,)) if num_layers is None else ((num_layers, dim), ("n_layer", None))
        )
        self.weight = _param(rngs, shape, names, nnx.initializers.ones)


class Layers(nnx.Module):
    """All decoder layers' weights, stacked along ``n_layer`` (Hugging Face names)."""

    def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
        n, e = c.num_layers, c.hidden_size
        self.input_layernorm = Norm(e, num_layers=n, rngs=rngs)
        bias = c.attention_bias
        self.q_proj = Proj(n, c.n_q, e, ("n_q", "n_embd"), bias=bias, rngs=rngs)
        self.k_proj = Proj(n, c.n_kv, e, ("n_kv", "n_embd"), bias=bias, rngs=rngs)
        self.v_proj = Proj(n, c.n_kv, e, ("n_kv", "n_embd"), bias=bias, rngs=rngs)
        self.o_proj = Proj(n, e, c.n_q, ("n_embd", "n_q"), bias=False, rngs=rngs)
        if c.qk_norm:
            self.q_norm = Norm(c.dim_per_head, num_layers=n, rngs=rngs)
            self.k_norm = Norm(c.dim_per_head, num_layers=n, rngs=rngs)
        self.post_attention_layernorm = Norm(e, num_layers=n, rngs=rngs)
        mlp = c.intermediate_size
        self.gate_proj = Proj(n, mlp, e, ("n_mlp", "n_embd"), bias=False, rngs=rngs)
        self.up_proj = Proj(n, mlp, e, ("n_mlp", "n_embd"), bias=False, rngs=rngs)
        self.down_proj = Proj(n, e, mlp, ("n_embd", "n_mlp"), bias=False, rngs=rngs)


def qkv(layer: dict, h: jax.Array, cos, sin, *, head_dim: int, eps: float):
    """Queries, keys and values of one layer for normalised input ``h`` (batch, seq, n_embd):
    q (batch, seq, num_heads, head_dim), k and v (batch, seq, num_kv_heads, head_dim), with q/k
    normalised per head (when the layer has q/k norms) and rotated."""
    batch, seq, _ = h.shape
    q, k, v = (
        project(h, layer[name]).reshape(batch, seq, -1, head_dim)
        for name in ("q_proj", "k_proj", "v_proj")
    )
    if "q_norm" in layer:
        q = rms_norm(q, layer["q_norm"]["weight"], eps, q.dtype)
        k = rms_norm(k, layer["k_norm"]["weight"], eps, k.dtype)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def mlp(layer: dict, x: jax.Array, *, eps: float, dtype: jnp.dtype) -> jax.Array:
    """The residual stream ``x`` (batch, seq, n_embd) float32 after the SwiGLU MLP sublayer."""
    h = rms_norm(x, layer["post_attention_layernorm"]["weight"], eps, dtype)  # (batch, seq, e)
    gated = jax.nn.silu(project(h, layer["gate_proj"])) * project(h, layer["up_proj"])  # n_mlp
    return x + project(gated, layer["down_proj"]).astype(jnp.float32)  # (batch, seq, n_embd)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of q (batch, seq, heads, hd) over k, v (batch, seq, kv_heads, hd): JAX's
    kernel, whose implementation JAX chooses (``theseus doctor`` shows which one it gets)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def block(
    layer: dict,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    head_dim: int,
    eps: float,
    dtype: jnp.dtype,
) -> jax.Array:
    """One pre-norm decoder layer on the float32 residual stream ``x`` (batch, seq, n_embd);
    sublayers compute in ``dtype`` and add their outputs to the stream in float32."""
    h = rms_norm(x, layer["input_layernorm"]["weight"], eps, dtype)  # (batch, seq, n_embd)
    q, k, v = qkv(layer, h, cos, sin, head_dim=head_dim, eps=eps)
    attended = causal_attention(q, k, v)  # (batch, seq, heads, hd)
    batch, seq = x.shape[:2]
    out = project(attended.reshape(batch, seq, -1), layer["o_proj"])  # (batch, seq, n_embd)
    return mlp(layer, x + out.astype(jnp.float32), eps=eps, dtype=dtype)


class Llama(nnx.Module):
    """A Llama-family decoder: token embedding, ``num_layers`` pre-RMSNorm layers scanned with
    :func:`theseus.scan_layers`, a final RMSNorm and the output head.

    State paths (Hugging Face's names, layers stacked): ``embed_tokens`` (vocab, n_embd);
    ``norm/weight``; ``lm_head`` (vocab, n_embd) unless tied; under ``layers/``:
    ``input_layernorm``, ``post_attention_layernorm`` (``weight``: n_layer, None), ``q_proj``
    (``weight``: n_layer, n_q, n_embd; ``bias``: n_layer, n_q with attention_bias), ``k_proj`` and
    ``v_proj`` (n_layer, n_kv, n_embd), ``o_proj`` (n_layer, n_embd, n_q), ``q_norm`` and
    ``k_norm`` (n_layer, None; with qk_norm), ``gate_proj`` and ``up_proj`` (n_layer, n_mlp,
    n_embd), ``down_proj`` (n_layer, n_embd, n_mlp).

    Parameters are float32; matmuls and the activations between them run in ``compute_dtype``
    while norms' statistics, rotary embeddings, softmax, the residual stream and the logits stay
    float32. ``remat`` says what each layer recomputes in the backward pass (``"none"``,
    ``"full"``, ``"dots"``; see :func:`theseus.scan_layers`).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        rngs: nnx.Rngs,
        compute_dtype: DTypeLike = jnp.float32,
        remat: bool | str = False,
        lora: LoraSpec | None = None,
    ):
        c = config
        # Plain, hashable values (they become part of the graphdef), not the mutable config.
        scale = 0.0 if lora is None else lora.scale
        self.static = LlamaStatic.of(c, compute_dtype, remat=remat, lora_scale=scale)
        normal = nnx.initializers.normal(0.02)
        self.embed_tokens = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "n_embd"), normal)
        self.layers = Layers(c, rngs=rngs)
        self.norm = Norm(c.hidden_size, rngs=rngs)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "n_embd"), normal)
        if lora is not None:  # after the base weights, which keep their random streams
            add_adapters(self, lora, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Float32 logits ``(batch, seq, vocab)`` of int ``tokens`` ``(batch, seq)``."""
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.static)


@dataclass(frozen=True)
class LlamaStatic:
    """What :func:`forward` needs besides the parameters: plain, hashable values."""

    head_dim: int
    eps: float
    inv_freq: tuple[float, ...]
    compute_dtype: jnp.dtype
    remat: bool | str
    context_len: int
    lora_scale: float = 0.0  # alpha / rank of the LoRA adapters (0: none)

    @staticmethod
    def of(
        config: LlamaConfig,
        compute_dtype: DTypeLike,
        *,
        remat: bool | str = False,
        lora_scale: float = 0.0,
    ) -> LlamaStatic:
        inv_freq = tuple(float(f) for f in inverse_frequencies(config))
        return LlamaStatic(
            config.dim_per_head,
            config.rms_norm_eps,
            inv_freq,
            jnp.dtype(compute_dtype),
            remat,
            config.context_len,
            lora_scale,
        )


def forward(params: dict, tokens: jax.Array, static: LlamaStatic) -> jax.Array:
    """Logits ``(batch, seq, vocab)`` float32 of ``tokens`` (batch, seq) from a parameter dict."""
    _, seq = tokens.shape
    if seq > static.context_len:
        raise ValueError(
            f"sequence length {seq} exceeds the model's context of {static.context_len} "
            "positions (model.max_position_embeddings, or model.sliding_window if smaller)."
        )
    embed = params["embed_tokens"]  # (vocab, n_embd)
    x = embed[tokens].astype(jnp.float32)  # (batch, seq, n_embd) residual stream
    positions = jnp.broadcast_to(jnp.arange(seq), tokens.shape)  # (batch, seq)
    cos, sin = rotary(positions, np.asarray(static.inv_freq, np.float32))  # (batch, seq, hd)
    dtype = static.compute_dtype

    def one_layer(layer, x):
        layer = scaled(layer, static.lora_scale) if static.lora_scale else layer
        return block(layer, x, cos, sin, head_dim=static.head_dim, eps=static.eps, dtype=dtype)

    x = scan_layers(one_layer, x, params["layers"], remat=static.remat)  # gathered per layer
    return head(params, x, static.eps, dtype)


def head(params: dict, x: jax.Array, eps: float, dtype: jnp.dtype) -> jax.Array:
    """Logits (batch, seq, vocab) float32 of the residual stream ``x`` (batch, seq, n_embd)."""
    h = rms_norm(x, params["norm"]["weight"], eps, dtype)  # (batch, seq, n_embd)
    table = params.get("lm_head", params["embed_tokens"])  # (vocab, n_embd)
    return dense(h, table, jnp.float32, transposed=True)  # (batch, seq, vocab)


def num_params(config: LlamaConfig) -> int:
    """The exact number of parameters of ``Llama(config)``."""
    c = config
    attention = c.hidden_size * (2 * c.n_q + 2 * c.n_kv)
    attention += (c.n_q + 2 * c.n_kv) if c.attention_bias else 0
    attention += 2 * c.dim_per_head if c.qk_norm else 0
    per_layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    tables = (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size
    return c.num_layers * per_layer + tables + c.hidden_size
