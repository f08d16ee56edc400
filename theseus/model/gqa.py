"""What the rotary grouped-query decoders (Llama, OLMo 2, Gemma) share: their sharding plan, the
config fields that have the same meaning in each, the plain embedding and rotary features, the
matmul shapes, the cached decoder, and the Hugging Face keys and tensor names they have in common.
A family module adds only what makes it itself (its layer, its extra settings and tensors)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

from theseus.accounting.activations import DecoderShape
from theseus.model import windows as sliding
from theseus.model.attention import AttentionConfig
from theseus.model.cached_decoder import CachedDecoder
from theseus.model.decoder import (
    Attended,
    DecoderModel,
    LayerInputs,
    Skeleton,
    Weights,
)
from theseus.model.family import Context, Family, HFSpec, dense_matmuls
from theseus.model.parts import Norm, Projection, RMSNorm, param, stacked_projection, weights
from theseus.model.rotary import apply_rotary, inverse_frequencies, rotary
from theseus.sharding.axis import Axis, ShardingPlan

# TP splits the query heads (n_q = num_heads × head_dim), the key/value heads (n_kv) and the MLP
# over `shard`; the residual width, vocabulary and layer count stay whole on each TP device.
# Heads are contiguous slices of n_q and n_kv, so each device holds whole heads when tp divides
# num_kv_heads (correct for any tp that divides the widths). ZeRO also splits vocab over `batch`.
GQA_PLAN = ShardingPlan(
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

#: The Hugging Face modules peft adapts in these decoders (their projections' names).
PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def field(default: Any, description: str, **limits: Any) -> Any:
    return pydantic.Field(default, description=description, **limits)


class GQAConfig(AttentionConfig):
    """The hyperparameters every rotary grouped-query decoder has (the names of Hugging Face's
    configs). ``head_dim`` None means hidden_size / num_heads. rope_type ``linear`` divides the
    rotary frequencies by ``rope_factor``; ``llama3`` scales them as Llama 3.1 does with the
    ``rope_*`` factors; the attention kernel's settings as :class:`AttentionConfig`."""

    vocab_size: pydantic.StrictInt = field(256, "token ids", gt=0)
    hidden_size: pydantic.StrictInt = field(128, "residual width", gt=0)
    intermediate_size: pydantic.StrictInt = field(352, "MLP width", gt=0)
    num_layers: pydantic.StrictInt = field(4, "decoder layers", gt=0)
    num_heads: pydantic.StrictInt = field(4, "query heads", gt=0)
    num_kv_heads: pydantic.StrictInt = field(2, "key/value heads", gt=0)
    head_dim: pydantic.StrictInt | None = field(
        None, "head width; None: hidden_size / num_heads", gt=0
    )
    max_position_embeddings: pydantic.StrictInt = field(128, "context length", gt=0)
    rope_theta: float = field(10000.0, "rotary base", gt=0)
    rope_type: Literal["default", "linear", "llama3"] = field(
        "default", "rotary frequencies: plain, divided by rope_factor, or Llama 3.1's scaling"
    )
    rope_factor: float = field(8.0, "linear and llama3: scaling factor", gt=0)
    rope_low_freq_factor: float = field(1.0, "llama3: low factor", gt=0)
    rope_high_freq_factor: float = field(4.0, "llama3: high factor", gt=0)
    rope_original_max_position_embeddings: pydantic.StrictInt = field(
        8192, "llama3: original context length", gt=0
    )
    rms_norm_eps: float = field(1e-6, "RMSNorm epsilon", gt=0)
    tie_word_embeddings: bool = field(False, "output head = embedding")

    @pydantic.model_validator(mode="after")
    def _heads_fit(self) -> GQAConfig:
        owner = type(self).__name__
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{owner}.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"{owner}.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; set head_dim."
            )
        if self.dim_per_head % 2:
            raise ValueError(f"{owner}: head_dim={self.dim_per_head} must be even (rotary).")
        return self

    @property
    def context(self) -> Context:
        return Context(self.max_position_embeddings, "model.max_position_embeddings")

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

    @property
    def table_params(self) -> int:
        """Parameters of the token table, the untied head and the final norm."""
        tables = (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size
        return tables + self.hidden_size

    @property
    def projection_params(self) -> int:
        """Parameters of one layer's q, k, v, o and MLP weights (no biases)."""
        e = self.hidden_size
        return e * (2 * self.n_q + 2 * self.n_kv) + 3 * e * self.intermediate_size


class WindowedConfig(GQAConfig):
    """A :class:`GQAConfig` whose layers may slide: ``sliding_window`` is the attention window
    of the layers that do (a query reads the ``sliding_window`` latest positions up to its own);
    ``layer_types`` says which (Hugging Face's names; None: every layer when there is a window).
    Sequences may be longer than the window, in training and in decoding."""

    sliding_window: pydantic.StrictInt | None = field(
        None, "attention window of the sliding layers; None: whole context", gt=0
    )
    layer_types: tuple[sliding.LayerType, ...] | None = field(
        None, "each layer's attention; None: every layer slides when sliding_window is set"
    )

    @pydantic.model_validator(mode="after")
    def _windows_fit(self) -> WindowedConfig:
        window, layers = self.sliding_window, self.num_layers
        sliding.check_layer_types(type(self).__name__, self.layer_types, layers, window)
        return self

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: the whole context)."""
        return sliding.layer_windows(self.layer_types, self.num_layers, self.sliding_window)


@dataclass(frozen=True)
class Settings:
    """What a plain rotary layer reads besides its weights (Llama, OLMo 2)."""

    head_dim: int
    inv_freq: tuple[float, ...]
    compute_dtype: jnp.dtype


@weights
class Attention:
    """The weights of grouped-query self-attention (Hugging Face's names): the q, k, v and o
    projections and, in families that have them, the q and k norms."""

    q_proj: Projection
    k_proj: Projection
    v_proj: Projection
    o_proj: Projection
    q_norm: Norm | None = None
    k_norm: Norm | None = None


@weights
class WholeNormedAttention(Attention):
    """Grouped-query attention whose q and k projections are RMS-normed over all heads
    (``q_norm`` n_q wide, ``k_norm`` n_kv wide) before the rotary embedding (OLMo 2, OLMoE)."""

    q_norm: RMSNorm
    k_norm: RMSNorm


@weights
class MLP:
    """The weights of a gated MLP: gate and up (n_embd to n_mlp), down."""

    gate_proj: Projection
    up_proj: Projection
    down_proj: Projection


@weights
class OutputNorms:
    """The norms of the attention's and the MLP's outputs (OLMo 2, Gemma)."""

    post_attention_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm


class Model(DecoderModel):
    """A rotary grouped-query decoder: ``embed_tokens``, ``layers`` (the family's layer type),
    the final ``norm`` and ``lm_head`` (None: tied to the token table)."""

    layers: Any = nnx.data()
    norm: Norm = nnx.data()
    embed_tokens: nnx.Param  # (vocab, n_embd), a Variable: data without marking
    lm_head: nnx.Param | None

    def weights(self) -> Weights:
        table, norm = self.embed_tokens, self.norm
        return Weights(table=table, layers=self.layers, final_norm=norm, head=self.lm_head)


def embed(w: Weights, tokens: jax.Array, positions: jax.Array, s: Any) -> jax.Array:
    del positions, s  # positions enter through the rotary features
    return w.table[tokens].astype(jnp.float32)  # (batch, seq, n_embd)


def features(positions: jax.Array, s: Settings) -> tuple[jax.Array, jax.Array]:
    return rotary(positions, s.inv_freq)  # cos, sin (batch or 1, seq, head_dim)


def rotary_skeleton(
    c: GQAConfig, compute_dtype: Any, remat: bool | str = False, *, layer: Callable
) -> Skeleton:
    """The skeleton of a decoder of ``layer``s that reads :class:`Settings`: the plain token
    table, rotary features of ``c``'s frequencies."""
    dtype = jnp.dtype(compute_dtype)
    inv_freq = tuple(float(f) for f in inverse_frequencies(c.dim_per_head, dict(c)))
    return Skeleton(
        embed=embed,
        features=features,
        layer=layer,
        settings=Settings(c.dim_per_head, inv_freq, dtype),
        compute_dtype=dtype,
        context=c.context,
        remat=remat,
        attention=c.attention_options,
    )


def attention_projections(
    c: GQAConfig, rngs: nnx.Rngs, bias: bool = False, head_norm: Callable | None = None
) -> dict[str, Any]:
    """Each layer's q, k, v (with biases when ``bias``) and o projections, Hugging Face's
    ``(d_out, d_in)`` layout, stacked along ``n_layer``, then per-head q and k norms
    ``head_norm(head_dim)`` when given (an :class:`Attention`'s fields)."""
    n, e, hd = c.num_layers, c.hidden_size, c.dim_per_head

    def proj(d_in, d_out, names, with_bias):
        return stacked_projection(n, d_in, d_out, names, "oi", bias=with_bias, std=0.02, rngs=rngs)

    return {
        "q_proj": proj(e, c.n_q, ("n_embd", "n_q"), bias),
        "k_proj": proj(e, c.n_kv, ("n_embd", "n_kv"), bias),
        "v_proj": proj(e, c.n_kv, ("n_embd", "n_kv"), bias),
        "o_proj": proj(c.n_q, e, ("n_q", "n_embd"), False),
    } | ({} if head_norm is None else {"q_norm": head_norm(hd), "k_norm": head_norm(hd)})


def whole_normed_projections(c: GQAConfig, rngs: nnx.Rngs) -> dict[str, Any]:
    """:func:`attention_projections` and q and k norms over all heads after them (the fields of
    :class:`WholeNormedAttention`)."""
    rms = rms_norms(c, rngs)
    return attention_projections(c, rngs) | {
        "q_norm": rms(c.n_q, "n_q"),
        "k_norm": rms(c.n_kv, "n_kv"),
    }


def mlp_projections(c: GQAConfig, rngs: nnx.Rngs) -> dict[str, Any]:
    """Each layer's gated MLP: gate and up (n_embd to n_mlp), down (:class:`MLP`'s fields)."""
    n, e, mlp = c.num_layers, c.hidden_size, c.intermediate_size

    def proj(d_in, d_out, names):
        return stacked_projection(n, d_in, d_out, names, "oi", bias=False, std=0.02, rngs=rngs)

    return {
        "gate_proj": proj(e, mlp, ("n_embd", "n_mlp")),
        "up_proj": proj(e, mlp, ("n_embd", "n_mlp")),
        "down_proj": proj(mlp, e, ("n_mlp", "n_embd")),
    }


def token_table(c: GQAConfig, rngs: nnx.Rngs) -> nnx.Param:
    """The token table (vocab, n_embd), normal(0.02) initialised (a family creates it first)."""
    shape = (c.vocab_size, c.hidden_size)
    return param(rngs, shape, ("vocab", "n_embd"), nnx.initializers.normal(0.02))


def rms_norms(c: GQAConfig, rngs: nnx.Rngs, offset: float = 0.0) -> Callable[..., RMSNorm]:
    """``norm(dim, name=None)``: a stacked RMSNorm (n_layer, dim) named (``n_layer``, name),
    of ``c``'s epsilon and the scale ``offset``."""

    def norm(dim: int, name: str | None = None) -> RMSNorm:
        names = ("n_layer", name)
        return RMSNorm.create((c.num_layers, dim), names, c.rms_norm_eps, rngs=rngs, offset=offset)

    return norm


def add_head(model: Model, c: GQAConfig, rngs: nnx.Rngs, offset: float = 0.0) -> None:
    """The final RMSNorm ``norm`` (scale ``offset``) and, unless the head is tied, ``lm_head``
    (created last)."""
    model.norm = RMSNorm.create((c.hidden_size,), (None,), c.rms_norm_eps, rngs=rngs, offset=offset)
    model.lm_head = None if c.tie_word_embeddings else token_table(c, rngs)


def self_attention(
    a: Attention,
    h: jax.Array,
    inputs: LayerInputs,
    rotation: tuple[jax.Array, jax.Array],
    head_dim: int,
) -> Attended:
    """Grouped-query self-attention of the normed stream ``h`` (batch, seq, n_embd): q, k, v
    heads, q and k normed per head when ``a`` has q/k norms, the rotary ``rotation`` (cos, sin),
    ``inputs.attend``, ``o_proj``: :class:`Attended` (batch, seq, n_embd) in ``h``'s dtype."""
    batch, seq, _ = h.shape
    q, k, v = (
        proj(h).reshape(batch, seq, -1, head_dim) for proj in (a.q_proj, a.k_proj, a.v_proj)
    )  # q (batch, seq, heads, head_dim); k, v (batch, seq, kv_heads, head_dim)
    if a.q_norm is not None and a.k_norm is not None:
        q, k = a.q_norm(q, q.dtype), a.k_norm(k, k.dtype)
    attended = inputs.attend(apply_rotary(q, *rotation), apply_rotary(k, *rotation), v)
    return replace(attended, output=a.o_proj(attended.output.reshape(batch, seq, -1)))


def whole_normed_attention(
    a: WholeNormedAttention,
    h: jax.Array,
    inputs: LayerInputs,
    rotation: tuple[jax.Array, jax.Array],
    head_dim: int,
) -> Attended:
    """Self-attention of ``h`` (batch, seq, n_embd) as :func:`self_attention`, but q and k
    normed over all heads before they are split into heads and rotated."""
    batch, seq, _ = h.shape
    q = a.q_norm(a.q_proj(h), h.dtype)  # (batch, seq, n_q)
    k = a.k_norm(a.k_proj(h), h.dtype)  # (batch, seq, n_kv)
    q, k, v = (t.reshape(batch, seq, -1, head_dim) for t in (q, k, a.v_proj(h)))  # (.., heads, hd)
    attended = inputs.attend(apply_rotary(q, *rotation), apply_rotary(k, *rotation), v)
    return replace(attended, output=a.o_proj(attended.output.reshape(batch, seq, -1)))


def gated_mlp(m: MLP, h: jax.Array, activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``down(activation(gate(h)) · up(h))`` of ``h`` (batch, seq, n_embd), in ``h``'s dtype."""
    return m.down_proj(activation(m.gate_proj(h)) * m.up_proj(h))  # (batch, seq, n_embd)


def decoder_shape(c: GQAConfig) -> DecoderShape:
    """The dimensions of a rotary grouped-query decoder's activations (a gated MLP)."""
    return DecoderShape(
        num_layers=c.num_layers,
        width=c.hidden_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.dim_per_head,
        mlp_width=c.intermediate_size,
        vocab_size=c.vocab_size,
        gated_mlp=True,
    )


def family(
    name: str,
    config_class: type[GQAConfig],
    model_class: type[DecoderModel],
    num_params: Callable[[Any], int],
    hf: HFSpec,
    descriptions: dict[str, str],
) -> Family:
    """A rotary grouped-query family: :data:`GQA_PLAN`, its dense matmuls, the cached decoder of
    the model's skeleton, trainer ``<Model>Trainer``."""
    return Family(
        name=name,
        trainer_name=f"{model_class.__name__}Trainer",
        config_class=config_class,
        model_class=model_class,
        plan=GQA_PLAN,
        context=lambda c: c.context,
        matmuls=lambda c: dense_matmuls(decoder_shape(c)),
        num_params=num_params,
        shape=decoder_shape,
        decoder=partial(cached_decoder, model_class.skeleton_of),
        hf=hf,
        descriptions=descriptions,
    )


def cached_decoder(
    skeleton_of: Callable[..., Skeleton], c: GQAConfig, compute_dtype: Any, graphdef: Any
) -> CachedDecoder:
    """The KV-cache decoder of ``skeleton_of(c, ...)`` and the model ``graphdef``: caches n_kv
    wide, split as k/v are."""
    dims = (c.vocab_size, c.num_layers, c.dim_per_head, c.n_kv)
    return CachedDecoder(skeleton_of(c, compute_dtype), graphdef, *dims, (None, "n_kv"))
