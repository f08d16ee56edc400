"""The Qwen3-MoE family: Qwen3-30B-A3B, Qwen3-235B-A22B and their kind (``model_type``
``qwen3_moe``).

Qwen3's attention (per-head q/k RMSNorm, rotary, grouped-query heads, a window on every layer
when ``use_sliding_window``) with an expert block in place of the MLP: a softmax router over
``num_experts`` experts, the ``num_experts_per_tok`` best, renormalised when ``norm_topk_prob``,
each a SwiGLU MLP ``moe_intermediate_size`` wide (:mod:`theseus.model.experts`). Training adds
``router_aux_loss_coef`` times the load-balancing loss. Weights are stored as Hugging Face stores
them, ``(d_out, d_in)``, stacked along ``n_layer`` (and ``n_expert``), so checkpoints import and
export without permuting anything. Every layer has experts: ``decoder_sparse_step`` 1 and no
``mlp_only_layers``, as every published Qwen3-MoE checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.model import gqa, gqa_hf, moe
from theseus.model.decoder import LayerInputs, LayerOutput, PerLayer
from theseus.model.experts import Experts
from theseus.model.family import HFSpec, HFTensor
from theseus.model.gqa import field
from theseus.model.moe import MoEConfig, MoESettings
from theseus.model.parts import RMSNorm, weights
from theseus.model.rotary import rope_from_hf, rope_to_hf


class Qwen3MoeConfig(MoEConfig):
    """Hyperparameters of a Qwen3-MoE decoder (the names of Hugging Face's config). A window
    (``sliding_window``) applies to every layer; ``head_dim`` None means hidden_size /
    num_heads. ``decoder_sparse_step`` and ``mlp_only_layers`` are Hugging Face's: theseus
    reproduces the models whose every layer has experts."""

    norm_topk_prob: bool = field(False, "renormalise the chosen experts' weights to sum to 1")
    decoder_sparse_step: pydantic.StrictInt = field(1, "every k-th layer has experts", ge=1, le=1)
    mlp_only_layers: tuple[pydantic.StrictInt, ...] = field(
        (), "layers with a dense MLP instead of experts", max_length=0
    )


@weights
class Layer(gqa.Attention):
    """A Qwen3-MoE layer's weights: attention with per-head q/k norms, the two norms, the
    expert block ``mlp``."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp: Experts


def block(layer: Layer, x: jax.Array, inputs: LayerInputs, s: MoESettings) -> LayerOutput:
    """One pre-RMSNorm layer on the float32 stream ``x`` (batch, seq, n_embd): attention with
    per-head q/k norms and rotary q/k, then the expert block; its routing goes out with it."""
    h = layer.input_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
    attended = gqa.self_attention(layer, h, inputs, inputs.features, s.head_dim)
    x, routing = moe.expert_sublayer(layer, x + attended.output.astype(jnp.float32), s)
    return LayerOutput(x, attended.cache, routing)


def skeleton(c: Qwen3MoeConfig, compute_dtype: DTypeLike, remat: bool | str = False):
    sk = gqa.rotary_skeleton(c, compute_dtype, remat, layer=block)
    return moe.routed(replace(sk, per_layer=PerLayer(windows=c.windows)), c)


class Qwen3Moe(gqa.Model):
    """A Qwen3-MoE decoder (see the module docstring). State paths are Hugging Face's names,
    layers stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` unless tied; under
    ``layers/``: the norms, ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
    ``k_norm`` and the expert block ``mlp`` (``gate/weight`` the router, ``gate_proj``,
    ``up_proj``, ``down_proj`` (n_layer, n_expert, ...))."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: Qwen3MoeConfig, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)
        rms = gqa.rms_norms(c, rngs)
        self.layers = Layer(
            input_layernorm=rms(c.hidden_size),
            **gqa.attention_projections(c, rngs, head_norm=rms),
            post_attention_layernorm=rms(c.hidden_size),
            mlp=moe.expert_block(c, c.norm_topk_prob, rngs),
        )
        gqa.add_head(self, c, rngs)


def num_params(c: Qwen3MoeConfig) -> int:
    """The exact number of parameters of ``Qwen3Moe(c)``."""
    attention = moe.attention_params(c, 2 * c.dim_per_head)  # per-head q/k norms
    return c.num_layers * attention + moe.expert_params(c) + c.table_params


# --- Hugging Face: Qwen3MoeForCausalLM ---------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of a Qwen3-MoE ``config.json``."""
    del model_type
    gqa_hf.check_key(hf, "hidden_act", "silu", "silu", where)
    gqa_hf.check_key(hf, "attention_bias", False, False, where)
    gqa_hf.check_key(hf, "decoder_sparse_step", 1, 1, where)
    gqa_hf.check_key(hf, "mlp_only_layers", [], [], where)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return {
        **gqa_hf.from_hf_common(hf, 128, 1e-6),
        **moe.from_hf(hf),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "sliding_window": window,
        **rope_from_hf(hf, where),
    }


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type
    window = model.get("sliding_window")
    return gqa_hf.to_hf_common(model) | moe.to_hf(model) | {
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(model),
        "attention_bias": False,
        "norm_topk_prob": model["norm_topk_prob"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": window is not None,
        "sliding_window": window,
    }  # fmt: skip


def tensors(model: dict[str, Any], experts: list[HFTensor]) -> list[HFTensor]:
    """The checkpoint's tensors around the ``experts``' (one layout of :mod:`~theseus.model.moe`)."""
    head_dim = gqa_hf.widths(model)[0]
    norms = {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}  # per head
    return gqa_hf.checkpoint_tensors(model, moe.layer_shapes(model) | norms, experts)


FAMILY = moe.family(
    name="qwen3_moe",
    config_class=Qwen3MoeConfig,
    model_class=Qwen3Moe,
    num_params=num_params,
    hf=HFSpec(
        architectures={"qwen3_moe": "Qwen3MoeForCausalLM"},
        from_hf=from_hf,
        export_type=lambda model, imported: "qwen3_moe",
        to_hf=to_hf,
        **moe.tensor_layouts(tensors),
    ),
    descriptions={
        "train/pretrain": "train a Qwen3-MoE decoder (mixture of experts) on byte or token data",
        "evaluate": "validation loss of the latest Qwen3-MoE checkpoint of a run",
    },
)
