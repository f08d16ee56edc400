"""GPT-2: learned positions, pre-LayerNorm blocks, tanh-GELU MLP, output head tied to the token
embedding; dropout where GPT-2 applies it. Weights are ``(d_in, d_out)`` kernels as GPT-2's
Conv1D stores them, stacked along ``n_layer``; exported and imported as ``GPT2LMHeadModel``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.accounting.activations import DecoderShape
from theseus.model.attention import AttentionConfig
from theseus.model.cached_decoder import CachedDecoder
from theseus.model.decoder import (
    DecoderModel,
    LayerInputs,
    LayerOutput,
    Skeleton,
    Weights,
)
from theseus.model.family import Context, Family, HFSpec, HFTensor, Part, dense_matmuls, whole
from theseus.model.layers import apply_dropout, keep_masks
from theseus.model.parts import LayerNorm, Projection, param, stacked_projection, weights
from theseus.sharding.axis import Axis, ShardingPlan

# TP splits the attention width and the MLP width over `shard`; everything else is whole on each
# TP device. Heads are contiguous slices of n_attn, so each device holds whole heads when tp
# divides n_head (results are correct for any tp). ZeRO partitions over `batch` the TP-split
# widths and also the vocabulary and position tables, which TP leaves whole.
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
EPS = 1e-5  # GPT-2's LayerNorm epsilon
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")  # GPT-2's activation_function names of tanh GELU


class GPTConfig(AttentionConfig):
    """GPT-2 hyperparameters (the fields' descriptions say what each is): ``vocab_size`` rows
    of the token table and the tied head, ``block_size`` of the position table; ``n_head``
    divides ``n_embd`` (for efficient TP, a multiple of ``tp``: each device holds whole heads);
    ``dropout`` applies in training where GPT-2 applies it (embeddings, attention probabilities,
    the attention and MLP branches into the residual stream). The attention kernel's settings
    are :class:`~theseus.model.attention.AttentionConfig`'s."""

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
    def attention_dropout(self) -> float:
        """``dropout``: GPT-2 drops attention probabilities at its one rate."""
        return self.dropout

    @property
    def n_attn(self) -> int:
        """Width of the q, k and v projections (all heads together)."""
        return self.n_embd

    @property
    def n_mlp(self) -> int:
        """Hidden width of the MLP."""
        return self.mlp_ratio * self.n_embd


@dataclass(frozen=True)
class Settings:
    n_head: int
    dropout: float
    compute_dtype: jnp.dtype


@weights
class Block:
    """One GPT-2 block's weights (GPT-2's names), stacked along ``n_layer``: LayerNorms (n_layer,
    None); kernels (n_layer, d_in, d_out) named (``n_layer``, in, out); biases named after their
    output, replicated (n_layer, None) when it is n_embd."""

    ln1: LayerNorm
    attn_q: Projection
    attn_k: Projection
    attn_v: Projection
    attn_out: Projection
    ln2: LayerNorm
    mlp_fc: Projection
    mlp_proj: Projection


def embed(w: Weights, tokens: jax.Array, positions: jax.Array, s: Settings) -> jax.Array:
    """Token plus position embedding, (batch, seq, n_embd) float32."""
    return w.table[tokens].astype(jnp.float32) + w.positions[positions].astype(jnp.float32)


def block(layer: Block, x: jax.Array, inputs: LayerInputs, s: Settings) -> LayerOutput:
    """One pre-LayerNorm block on the float32 stream ``x`` (batch, seq, n_embd); with this
    layer's per-example keys, attention probabilities and both residual branches drop out."""
    batch, seq, n_embd = x.shape
    shapes = [(s.n_head, seq, seq), (seq, n_embd), (seq, n_embd)]  # one draw of bits per example
    probs_keep, attn_keep, mlp_keep = keep_masks(inputs.keys, s.dropout, shapes)
    h = layer.ln1(x, s.compute_dtype)  # (batch, seq, n_embd)
    q, k, v = (
        p(h).reshape(batch, seq, s.n_head, -1) for p in (layer.attn_q, layer.attn_k, layer.attn_v)
    )  # (batch, seq, n_head, head_dim)
    attended = inputs.attend(q, k, v, probs_keep)
    heads = attended.output.reshape(batch, seq, -1)  # (batch, seq, n_attn)
    x = x + apply_dropout(layer.attn_out(heads), attn_keep, s.dropout).astype(jnp.float32)
    h = jax.nn.gelu(layer.mlp_fc(layer.ln2(x, s.compute_dtype)), approximate=True)  # n_mlp wide
    branch = apply_dropout(layer.mlp_proj(h), mlp_keep, s.dropout)
    return LayerOutput(x + branch.astype(jnp.float32), attended.cache)  # (batch, seq, n_embd)


def skeleton(c: GPTConfig, compute_dtype: DTypeLike, remat: bool | str = False):
    dtype = jnp.dtype(compute_dtype)
    return Skeleton(
        embed=embed,
        layer=block,
        settings=Settings(c.n_head, c.dropout, dtype),
        compute_dtype=dtype,
        context=Context(c.block_size, "model.block_size"),
        dropout=c.dropout,
        remat=remat,
        attention=c.attention_options,
    )


class GPT(DecoderModel):
    """GPT-2 (see the module docstring). State paths: ``wte`` (vocab, n_embd), ``wpe``
    (block_size, n_embd), ``blocks`` (a :class:`Block`), ``ln_f`` unannotated. Dropout
    (``GPTConfig.dropout``) applies only with ``deterministic=False``, one key per example."""

    skeleton_of = staticmethod(skeleton)
    blocks: Block = nnx.data()
    ln_f: LayerNorm = nnx.data()

    def build(self, c: GPTConfig, rngs: nnx.Rngs) -> None:
        normal = nnx.initializers.normal(0.02)
        self.wte = param(rngs, (c.vocab_size, c.n_embd), ("vocab", "n_embd"), normal)
        self.wpe = param(rngs, (c.block_size, c.n_embd), ("block_size", "n_embd"), normal)
        n, e, std = c.n_layer, c.n_embd, 0.02
        residual = 0.02 / math.sqrt(2 * n)  # GPT-2: projections into the residual stream

        def proj(d_in, d_out, names, std):
            return stacked_projection(n, d_in, d_out, names, "io", bias=True, std=std, rngs=rngs)

        def layer_norm():
            return LayerNorm.create((n, e), ("n_layer", None), EPS, rngs=rngs)

        self.blocks = Block(
            ln1=layer_norm(),
            **{f"attn_{x}": proj(e, c.n_attn, ("n_embd", "n_attn"), std) for x in "qkv"},
            attn_out=proj(c.n_attn, e, ("n_attn", "n_embd"), residual),
            ln2=layer_norm(),
            mlp_fc=proj(e, c.n_mlp, ("n_embd", "n_mlp"), std),
            mlp_proj=proj(c.n_mlp, e, ("n_mlp", "n_embd"), residual),
        )
        self.ln_f = LayerNorm.create((e,), None, EPS, rngs=rngs)

    def weights(self) -> Weights:
        return Weights(table=self.wte, layers=self.blocks, final_norm=self.ln_f, positions=self.wpe)


def num_params(c: GPTConfig) -> int:
    """The exact number of parameters of ``GPT(c)`` (the head is tied to ``wte``)."""
    attention = 3 * (c.n_embd + 1) * c.n_attn + (c.n_attn + 1) * c.n_embd
    mlp = (c.n_embd + 1) * c.n_mlp + (c.n_mlp + 1) * c.n_embd
    layer = 4 * c.n_embd + attention + mlp
    return (c.vocab_size + c.block_size) * c.n_embd + c.n_layer * layer + 2 * c.n_embd


def decoder_shape(c: GPTConfig) -> DecoderShape:
    """The dimensions of GPT's activations: one MLP up projection, biased projections."""
    return DecoderShape(
        num_layers=c.n_layer,
        width=c.n_embd,
        num_heads=c.n_head,
        num_kv_heads=c.n_head,
        head_dim=c.n_attn // c.n_head,
        mlp_width=c.n_mlp,
        vocab_size=c.vocab_size,
        gated_mlp=False,
        biased=True,
    )


def decoder(c: GPTConfig, compute_dtype: DTypeLike, graphdef: Any) -> CachedDecoder:
    dims = (c.vocab_size, c.n_layer, c.n_attn // c.n_head, c.n_attn)
    return CachedDecoder(skeleton(c, compute_dtype), graphdef, *dims, ("block_size", "n_attn"))


# --- Hugging Face: GPT2LMHeadModel -------------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of a GPT-2 ``config.json``."""
    del model_type
    n_embd = hf["n_embd"]
    n_inner = hf.get("n_inner") or 4 * n_embd
    act = hf.get("activation_function", "gelu_new")
    eps = float(hf.get("layer_norm_epsilon", 1e-5))
    checks = [
        (n_inner % n_embd == 0, f"n_inner={n_inner} is not a multiple of n_embd={n_embd}"),
        (act in TANH_GELU, f"activation_function={act!r}; theseus's GPT uses tanh GELU"),
        (eps == EPS, f"layer_norm_epsilon={hf.get('layer_norm_epsilon')}; theseus's GPT uses 1e-5"),
        (hf.get("scale_attn_weights", True), "scale_attn_weights=false is not supported"),
        (
            not hf.get("scale_attn_by_inverse_layer_idx") and not hf.get("reorder_and_upcast_attn"),
            "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"{where}: {message}")
    return {
        "vocab_size": hf["vocab_size"],
        "block_size": hf.get("n_positions", hf.get("n_ctx", 1024)),
        "n_layer": hf["n_layer"],
        "n_head": hf["n_head"],
        "n_embd": n_embd,
        "mlp_ratio": n_inner // n_embd,
        "dropout": 0.0,
    }


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type
    return {
        "vocab_size": model["vocab_size"],
        "n_positions": model["block_size"],
        "n_embd": model["n_embd"],
        "n_layer": model["n_layer"],
        "n_head": model["n_head"],
        "n_inner": model["mlp_ratio"] * model["n_embd"],
        "activation_function": "gelu_new",
        "layer_norm_epsilon": EPS,
        "tie_word_embeddings": True,
    }


def tensors(model: dict[str, Any]) -> list[HFTensor]:
    """``transformer.`` tensors (head tied); ``c_attn`` holds q, k and v side by side."""
    e, vocab = model["n_embd"], model["vocab_size"]
    inner = model["mlp_ratio"] * e
    found = [
        whole("transformer.wte.weight", (vocab, e), "wte"),
        whole("transformer.wpe.weight", (model["block_size"], e), "wpe"),
    ]
    for layer in range(model["n_layer"]):
        prefix = f"transformer.h.{layer}."
        for hf, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
            for hf_leaf, leaf in (("weight", "scale"), ("bias", "bias")):
                found.append(whole(f"{prefix}{hf}.{hf_leaf}", (e,), f"blocks/{ours}/{leaf}", layer))
        for leaf, ours, shape in (("weight", "kernel", (e, 3 * e)), ("bias", "bias", (3 * e,))):
            parts = tuple(
                Part(f"blocks/attn_{x}/{ours}", layer, i * e, (i + 1) * e)
                for i, x in enumerate("qkv")
            )
            found.append(HFTensor(f"{prefix}attn.c_attn.{leaf}", shape, parts))
        for hf, ours, d_in, d_out in (
            ("attn.c_proj", "attn_out", e, e),
            ("mlp.c_fc", "mlp_fc", e, inner),
            ("mlp.c_proj", "mlp_proj", inner, e),
        ):
            name, path = f"{prefix}{hf}", f"blocks/{ours}"
            found.append(whole(f"{name}.weight", (d_in, d_out), f"{path}/kernel", layer))
            found.append(whole(f"{name}.bias", (d_out,), f"{path}/bias", layer))
    found.append(whole("transformer.ln_f.weight", (e,), "ln_f/scale"))
    found.append(whole("transformer.ln_f.bias", (e,), "ln_f/bias"))
    return found


def aliases(name: str) -> tuple[str, ...]:
    """GPT-2's original files have no ``transformer.`` prefix."""
    return (name, name.removeprefix("transformer.")) if name.startswith("transformer.") else (name,)


FAMILY = Family(
    name="gpt",
    trainer_name="GPTTrainer",
    config_class=GPTConfig,
    model_class=GPT,
    plan=GPT_PLAN,
    context=lambda c: Context(c.block_size, "model.block_size"),
    matmuls=lambda c: dense_matmuls(decoder_shape(c)),  # the head is tied to the embedding
    num_params=num_params,
    shape=decoder_shape,
    decoder=decoder,
    hf=HFSpec(
        architectures={"gpt2": "GPT2LMHeadModel"},
        from_hf=from_hf,
        export_type=lambda model, imported: "gpt2",
        to_hf=to_hf,
        tensors=tensors,
        aliases=aliases,
    ),
    descriptions={
        "train/pretrain": "pretrain GPT on byte or token data",
        "evaluate": "validation loss of the latest GPT checkpoint of a run",
    },
)
