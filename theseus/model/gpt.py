"""GPT-2 in Flax NNX with per-layer weights stacked along ``n_layer`` and scanned.

Every weight is one float32 ``nnx.Param`` whose logical names sit in its ``out_sharding``
metadata; the trainer resolves them with :data:`GPT_PLAN`, the model's one plan (read by
:class:`~theseus.training.gpt.GPTTrainer`). Parameters are never sharded eagerly
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

from theseus.config import Section
from theseus.model.layers import (
    apply_dropout,
    causal_attention,
    dense,
    dropout,
    fold_in,
    keep_masks,
    layer_norm,
    linear,
)
from theseus.model.lora import LoraSpec, add_adapters, scaled
from theseus.sharding.axis import Axis, ShardingPlan
from theseus.sharding.layer_scan import scan_layers

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
        dropout: dropout rate in training where GPT-2 applies it (embeddings, attention
            probabilities, the attention and MLP branches into the residual stream); in [0, 1).
    """

    vocab_size: pydantic.StrictInt = pydantic.Field(256, gt=0, description="token ids")
    block_size: pydantic.StrictInt = pydantic.Field(128, gt=0, description="max sequence length")
    n_layer: pydantic.StrictInt = pydantic.Field(4, gt=0, description="transformer blocks")
    n_head: pydantic.StrictInt = pydantic.Field(4, gt=0, description="attention heads")
    n_embd: pydantic.StrictInt = pydantic.Field(128, gt=0, description="residual width")
    mlp_ratio: pydantic.StrictInt = pydantic.Field(4, gt=0, description="MLP width / n_embd")
    dropout: float = pydantic.Field(0.0, ge=0, lt=1, description="dropout rate in training")

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
    splits it with the kernel) and unannotated when it is ``n_embd`` (replicated). LoRA may
    adapt the kernel (:mod:`theseus.model.lora`).
    """

    lora_weight = "kernel"
    lora_layout = "io"

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


def block(
    layer: dict,
    x: jax.Array,
    keys: jax.Array | None,
    *,
    n_head: int,
    compute_dtype: jnp.dtype,
    dropout_rate: float,
) -> jax.Array:
    """One pre-LayerNorm transformer block.

    ``layer`` holds one layer's arrays (a slice of ``Blocks``' state as a pure dict); ``x`` is the
    float32 residual stream ``(batch, seq, n_embd)``. Sublayers compute in ``compute_dtype`` and
    their outputs are added to the residual stream in float32. With this layer's per-example
    ``keys`` (batch,), attention probabilities and both residual branches are dropped out.
    """
    _, seq, n_embd = x.shape
    shapes = [(n_head, seq, seq), (seq, n_embd), (seq, n_embd)]  # one draw of bits per example
    probs_keep, attn_keep, mlp_keep = keep_masks(keys, dropout_rate, shapes)
    h = layer_norm(x, **layer["ln1"], dtype=compute_dtype)  # (batch, seq, n_embd)
    q = linear(h, **layer["attn_q"])  # (batch, seq, n_attn)
    k = linear(h, **layer["attn_k"])  # (batch, seq, n_attn)
    v = linear(h, **layer["attn_v"])  # (batch, seq, n_attn)
    attended = causal_attention(
        q, k, v, n_head, dropout_rate=dropout_rate, keep=probs_keep
    )  # (batch, seq, n_attn)
    branch = apply_dropout(linear(attended, **layer["attn_out"]), attn_keep, dropout_rate)
    x = x + branch.astype(jnp.float32)  # (batch, seq, n_embd)
    h = layer_norm(x, **layer["ln2"], dtype=compute_dtype)  # (batch, seq, n_embd)
    h = jax.nn.gelu(linear(h, **layer["mlp_fc"]), approximate=True)  # (batch, seq, n_mlp)
    branch = apply_dropout(linear(h, **layer["mlp_proj"]), mlp_keep, dropout_rate)
    return x + branch.astype(jnp.float32)  # (batch, seq, n_embd)


class GPT(nnx.Module):
    """GPT-2: token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks scanned
    with :func:`theseus.scan_layers` (compile time independent of depth; one layer gathered at a
    time under FSDP), a final LayerNorm and an output
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
    logits stay float32. ``remat`` says what each layer recomputes in the backward pass
    (``"none"``, ``"full"``, ``"dots"``; see :func:`theseus.scan_layers`).

    Dropout (``GPTConfig.dropout``) applies only to calls with ``deterministic=False``, with one
    key per example: each example's masks are the same whatever the batch or its layout.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        rngs: nnx.Rngs,
        compute_dtype: DTypeLike = jnp.float32,
        remat: bool | str = False,
        lora: LoraSpec | None = None,
    ):
        # Plain ints, not the (mutable, unhashable) config: they become part of the graphdef.
        self.block_size = config.block_size
        self.n_head = config.n_head
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.remat = remat
        self.dropout = config.dropout
        self.lora_scale = 0.0 if lora is None else lora.scale
        embedding = nnx.initializers.normal(0.02)
        self.wte = _param(rngs, (config.vocab_size, config.n_embd), ("vocab", "n_embd"), embedding)
        self.wpe = _param(
            rngs, (config.block_size, config.n_embd), ("block_size", "n_embd"), embedding
        )
        self.blocks = Blocks(config, rngs=rngs)
        self.ln_f = LayerNorm(config.n_embd, rngs=rngs)
        if lora is not None:  # after the base weights, which keep their random streams
            add_adapters(self, lora, rngs=rngs)

    def __call__(
        self, tokens: jax.Array, keys: jax.Array | None = None, *, deterministic: bool = True
    ) -> jax.Array:
        """Float32 logits ``(batch, seq, vocab)`` of int ``tokens`` ``(batch, seq)``.

        ``deterministic=False`` (training) applies dropout with the per-example ``keys``
        ``(batch,)``, which it then needs; evaluation and generation keep the default True.
        """
        _, seq = tokens.shape
        if seq > self.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds GPTConfig.block_size={self.block_size}."
            )
        if deterministic or self.dropout == 0.0:
            keys = None
        elif keys is None:
            raise ValueError(
                f"GPT with dropout {self.dropout} called with deterministic=False needs one "
                "key per example: pass keys (batch,), e.g. Keys.examples in a trainer's loss"
            )
        wte = self.wte[...]  # (vocab, n_embd)
        x = wte[tokens].astype(jnp.float32) + self.wpe[...][:seq].astype(jnp.float32)
        x = dropout(x, self.dropout, fold_in(keys, 0))  # layer i draws from fold_in(keys, i + 1)
        layer_step = partial(
            block,
            n_head=self.n_head,
            compute_dtype=self.compute_dtype,
            dropout_rate=self.dropout,
        )

        def one_layer(inputs, x):
            layer, index = inputs
            layer = scaled(layer, self.lora_scale) if self.lora_scale else layer
            return layer_step(layer, x, fold_in(keys, index + 1))

        layers = nnx.to_pure_dict(nnx.state(self.blocks))  # arrays of shape (n_layer, ...)
        num_layers = jax.tree.leaves(layers)[0].shape[0]
        layers = (layers, jnp.arange(num_layers))  # each layer's weights and its index
        x = scan_layers(one_layer, x, layers, remat=self.remat)  # gathered per layer
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
