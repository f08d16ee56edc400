"""GPT-2 in Flax NNX with per-layer weights stacked along ``n_layer`` and scanned.

Every weight is one float32 ``nnx.Param`` whose logical names sit in its ``out_sharding``
metadata; the trainer resolves them with :data:`GPT_PLAN`. Parameters are never sharded eagerly
by flax, so the model builds (concretely or under ``nnx.eval_shape``) without a mesh.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.base.axis import Axis, ShardingPlan
from theseus.base.layer_scan import scan_layers
from theseus.config import Section
from theseus.model.layers import causal_attention, dense, layer_norm, linear

# TP splits the attention width and the MLP width over `shard`; everything else is whole on each
# TP device. Heads are contiguous slices of n_attn, so each device holds whole heads when tp
# divides n_head: n_head should be a multiple of tp for efficient attention (results are correct
# for any tp). ZeRO partitions over `batch` the TP-split widths and also the vocabulary and
# position tables, which TP leaves whole.
GPT_PLAN = ShardingPlan(
    tp=[
        ("n_attn", Axis.SHARD),
        ("n_mlp", Axis.SHARD),
        ("vocab", None),
        ("n_embd", None),
        ("block_size", None),
        ("n_layer", None),
    ],
    zero=[
        ("n_attn", Axis.BATCH),
        ("n_mlp", Axis.BATCH),
        ("vocab", Axis.BATCH),
        ("block_size", Axis.BATCH),
    ],
)

Names = tuple[str | None, ...]


class GPTConfig(Section):
    """GPT-2 hyperparameters.

    Attributes:
        vocab_size: number of token ids; the embedding table and the tied output head have this
            many rows.
        block_size: maximum sequence length (rows of the learned position embedding).
        n_layer: number of transformer blocks.
        n_head: number of attention heads; must divide ``n_embd``. For efficient TP it should
            also be a multiple of ``tp``, so each device holds whole heads.
        n_embd: width of the residual stream.
        mlp_ratio: MLP hidden width as a multiple of ``n_embd``.
    """

    vocab_size: pydantic.StrictInt = pydantic.Field(256, gt=0, description="token ids")
    block_size: pydantic.StrictInt = pydantic.Field(128, gt=0, description="max sequence length")
    n_layer: pydantic.StrictInt = pydantic.Field(4, gt=0, description="transformer blocks")
    n_head: pydantic.StrictInt = pydantic.Field(4, gt=0, description="attention heads")
    n_embd: pydantic.StrictInt = pydantic.Field(128, gt=0, description="residual width")
    mlp_ratio: pydantic.StrictInt = pydantic.Field(4, gt=0, description="MLP width / n_embd")

    @pydantic.model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}."
            )
        return self

    @property
    def n_attn(self) -> int:
        """Width of the q, k and v projections (all heads together)."""
        return self.n_embd

    @property
    def n_mlp(self) -> int:
        """Hidden width of the MLP."""
        return self.mlp_ratio * self.n_embd


def _param(
    rngs: nnx.Rngs, shape: tuple[int, ...], names: Names | None, init: nnx.Initializer
) -> nnx.Param:
    """A float32 parameter with its logical ``names`` in ``out_sharding`` (none when None).

    ``eager_sharding=False``: the names are logical, not mesh axes, so flax must never apply them.
    """
    if names is not None:
        init = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), eager_sharding=False)


class StackedLinear(nnx.Module):
    """``n_layer`` projections: kernel ``(n_layer, d_in, d_out)`` and bias ``(n_layer, d_out)``.

    The bias is named after the output dimension when that is ``n_attn`` or ``n_mlp`` (so TP
    splits it with the kernel) and unannotated when it is ``n_embd`` (replicated).
    """

    def __init__(
        self,
        n_layer: int,
        d_in: int,
        d_out: int,
        names: tuple[str, str],
        *,
        std: float,
        rngs: nnx.Rngs,
    ):
        in_name, out_name = names
        bias_name = None if out_name == "n_embd" else out_name
        kernel_names = ("n_layer", in_name, out_name)
        kernel_init = nnx.initializers.normal(std)
        self.kernel = _param(rngs, (n_layer, d_in, d_out), kernel_names, kernel_init)
        self.bias = _param(rngs, (n_layer, d_out), ("n_layer", bias_name), nnx.initializers.zeros)


class LayerNorm(nnx.Module):
    """LayerNorm scale and bias: ``(dim,)`` unannotated, or ``(n_layer, dim)`` named
    (``n_layer``, None) when stacked."""

    def __init__(self, dim: int, *, n_layer: int | None = None, rngs: nnx.Rngs):
        shape, names = ((dim,), None) if n_layer is None else ((n_layer, dim), ("n_layer", None))
        self.scale = _param(rngs, shape, names, nnx.initializers.ones)
        self.bias = _param(rngs, shape, names, nnx.initializers.zeros)


class Blocks(nnx.Module):
    """The weights of all transformer blocks, each stacked along a leading ``n_layer`` axis."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        n_layer, n_embd, n_attn, n_mlp = config.n_layer, config.n_embd, config.n_attn, config.n_mlp
        std = 0.02
        residual_std = 0.02 / math.sqrt(2 * n_layer)  # GPT-2: projections into the residual
        stacked_linear = partial(StackedLinear, n_layer, rngs=rngs)
        self.ln1 = LayerNorm(n_embd, n_layer=n_layer, rngs=rngs)
        self.attn_q = stacked_linear(n_embd, n_attn, ("n_embd", "n_attn"), std=std)
        self.attn_k = stacked_linear(n_embd, n_attn, ("n_embd", "n_attn"), std=std)
        self.attn_v = stacked_linear(n_embd, n_attn, ("n_embd", "n_attn"), std=std)
        self.attn_out = stacked_linear(n_attn, n_embd, ("n_attn", "n_embd"), std=residual_std)
        self.ln2 = LayerNorm(n_embd, n_layer=n_layer, rngs=rngs)
        self.mlp_fc = stacked_linear(n_embd, n_mlp, ("n_embd", "n_mlp"), std=std)
        self.mlp_proj = stacked_linear(n_mlp, n_embd, ("n_mlp", "n_embd"), std=residual_std)


def block(layer: dict, x: jax.Array, *, n_head: int, compute_dtype: jnp.dtype) -> jax.Array:
    """One pre-LayerNorm transformer block.

    ``layer`` holds one layer's arrays (a slice of ``Blocks``' state as a pure dict); ``x`` is the
    float32 residual stream ``(batch, seq, n_embd)``. Sublayers compute in ``compute_dtype`` and
    their outputs are added to the residual stream in float32.
    """
    h = layer_norm(x, **layer["ln1"], dtype=compute_dtype)  # (batch, seq, n_embd)
    q = linear(h, **layer["attn_q"])  # (batch, seq, n_attn)
    k = linear(h, **layer["attn_k"])  # (batch, seq, n_attn)
    v = linear(h, **layer["attn_v"])  # (batch, seq, n_attn)
    attended = causal_attention(q, k, v, n_head)  # (batch, seq, n_attn)
    x = x + linear(attended, **layer["attn_out"]).astype(jnp.float32)  # (batch, seq, n_embd)
    h = layer_norm(x, **layer["ln2"], dtype=compute_dtype)  # (batch, seq, n_embd)
    h = jax.nn.gelu(linear(h, **layer["mlp_fc"]), approximate=True)  # (batch, seq, n_mlp)
    return x + linear(h, **layer["mlp_proj"]).astype(jnp.float32)  # (batch, seq, n_embd)


class GPT(nnx.Module):
    """GPT-2: token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks scanned
    with ``jax.lax.scan`` (compile time independent of depth), a final LayerNorm and an output
    head tied to the token embedding.

    State paths and logical names: ``wte`` (vocab, n_embd); ``wpe`` (block_size, n_embd);
    ``ln_f/scale``, ``ln_f/bias`` unannotated; under ``blocks/``, stacked along ``n_layer``:
    ``ln1`` and ``ln2`` (``scale``, ``bias``: n_layer, None), ``attn_q``, ``attn_k``, ``attn_v``
    (``kernel``: n_layer, n_embd, n_attn; ``bias``: n_layer, n_attn), ``attn_out`` (``kernel``:
    n_layer, n_attn, n_embd), ``mlp_fc`` (``kernel``: n_layer, n_embd, n_mlp; ``bias``: n_layer,
    n_mlp), ``mlp_proj`` (``kernel``: n_layer, n_mlp, n_embd). Biases of width n_attn or n_mlp
    carry that name, so TP splits them with their kernel; n_embd-wide biases and LayerNorm
    parameters are replicated (n_layer, None).

    Parameters are float32 master weights; ``compute_dtype`` is the dtype of matmuls and of the
    activations between them, while LayerNorm statistics, softmax, the residual stream and the
    logits stay float32. ``remat=True`` recomputes each layer in the backward pass.
    """

    plan = GPT_PLAN

    def __init__(
        self,
        config: GPTConfig,
        *,
        rngs: nnx.Rngs,
        compute_dtype: DTypeLike = jnp.float32,
        remat: bool = False,
    ):
        # Plain ints, not the (mutable, unhashable) config: they become part of the graphdef.
        self.block_size = config.block_size
        self.n_head = config.n_head
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.remat = remat
        embedding = nnx.initializers.normal(0.02)
        self.wte = _param(rngs, (config.vocab_size, config.n_embd), ("vocab", "n_embd"), embedding)
        self.wpe = _param(
            rngs, (config.block_size, config.n_embd), ("block_size", "n_embd"), embedding
        )
        self.blocks = Blocks(config, rngs=rngs)
        self.ln_f = LayerNorm(config.n_embd, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Float32 logits ``(batch, seq, vocab)`` of int ``tokens`` ``(batch, seq)``."""
        _, seq = tokens.shape
        if seq > self.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds GPTConfig.block_size={self.block_size}."
            )
        wte = self.wte[...]  # (vocab, n_embd)
        x = wte[tokens] + self.wpe[...][:seq]  # (batch, seq, n_embd) float32 residual stream
        layer_step = partial(block, n_head=self.n_head, compute_dtype=self.compute_dtype)
        x = scan_layers(layer_step, x, self.blocks, remat=self.remat)  # gathered per layer
        h = layer_norm(x, **nnx.to_pure_dict(nnx.state(self.ln_f)), dtype=self.compute_dtype)
        return dense(h, wte, jnp.float32, transposed=True)  # (batch, seq, vocab)

    @staticmethod
    def num_params(config: GPTConfig) -> int:
        """The exact number of parameters of ``GPT(config)`` (the head is tied to ``wte``)."""
        c = config
        embeddings = (c.vocab_size + c.block_size) * c.n_embd
        layer_norms = 2 * 2 * c.n_embd
        attention = 3 * (c.n_embd + 1) * c.n_attn + (c.n_attn + 1) * c.n_embd
        mlp = (c.n_embd + 1) * c.n_mlp + (c.n_mlp + 1) * c.n_embd
        final_layer_norm = 2 * c.n_embd
        return embeddings + c.n_layer * (layer_norms + attention + mlp) + final_layer_norm
