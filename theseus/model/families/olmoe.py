"""The OLMoE family: AI2's OLMoE-1B-7B and its kind (``model_type`` ``olmoe``).

Llama's pre-norm layer with OLMo 2's q/k norms (RMSNorm of the whole query and key projections,
``q_norm`` n_q wide, ``k_norm`` n_kv wide, before the rotary embedding) and an expert block in
place of the MLP: a softmax router over ``num_experts`` experts, the ``num_experts_per_tok``
best with their probabilities as they are (``norm_topk_prob`` false, as OLMoE ships), each a
SwiGLU MLP ``intermediate_size`` wide (:mod:`theseus.model.experts`). Training adds
``router_aux_loss_coef`` (0.01) times the load-balancing loss. Weights are stored as Hugging Face
stores them, ``(d_out, d_in)``, stacked along ``n_layer`` (and ``n_expert``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from theseus.model import gqa, gqa_hf, moe
from theseus.model.decoder import LayerInputs, LayerOutput
from theseus.model.experts import Experts
from theseus.model.family import HFSpec, HFTensor
from theseus.model.gqa import field
from theseus.model.moe import MoEConfig, MoESettings
from theseus.model.parts import RMSNorm, weights
from theseus.model.rotary import rope_from_hf, rope_to_hf


class OlmoeConfig(MoEConfig):
    """Hyperparameters of an OLMoE decoder (the names of Hugging Face's config; each expert's
    width is ``moe_intermediate_size``, Hugging Face's ``intermediate_size``)."""

    norm_topk_prob: bool = field(False, "renormalise the chosen experts' weights to sum to 1")
    router_aux_loss_coef: float = field(0.01, "load-balancing loss coefficient", ge=0)


@weights
class Layer(gqa.WholeNormedAttention):
    """An OLMoE layer's weights: attention with q/k norms over all heads, the two norms, the
    expert block ``mlp``."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp: Experts


def block(layer: Layer, x: jax.Array, inputs: LayerInputs, s: MoESettings) -> LayerOutput:
    """One pre-RMSNorm layer on the float32 stream ``x`` (batch, seq, n_embd): attention with q
    and k normed over all heads, then rotated; then the expert block."""
    h = layer.input_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
    attended = gqa.whole_normed_attention(layer, h, inputs, inputs.features, s.head_dim)
    x, routing = moe.expert_sublayer(layer, x + attended.output.astype(jnp.float32), s)
    return LayerOutput(x, attended.cache, routing)


def skeleton(c: OlmoeConfig, compute_dtype: DTypeLike, remat: bool | str = False):
    return moe.routed(gqa.rotary_skeleton(c, compute_dtype, remat, layer=block), c)


class Olmoe(gqa.Model):
    """An OLMoE decoder (see the module docstring). State paths are Hugging Face's names, layers
    stacked: ``embed_tokens``, ``norm/weight``, ``lm_head``; under ``layers/``: the norms,
    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm`` (n_layer, n_q), ``k_norm``
    (n_layer, n_kv) and the expert block ``mlp``."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: OlmoeConfig, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)
        rms = gqa.rms_norms(c, rngs)
        self.layers = Layer(
            input_layernorm=rms(c.hidden_size),
            **gqa.whole_normed_projections(c, rngs),
            post_attention_layernorm=rms(c.hidden_size),
            mlp=moe.expert_block(c, c.norm_topk_prob, rngs),
        )
        gqa.add_head(self, c, rngs)


def num_params(c: OlmoeConfig) -> int:
    """The exact number of parameters of ``Olmoe(c)``."""
    attention = moe.attention_params(c, c.n_q + c.n_kv)  # q/k norms over all heads
    return c.num_layers * attention + moe.expert_params(c) + c.table_params


# --- Hugging Face: OlmoeForCausalLM ------------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of an OLMoE ``config.json``."""
    del model_type
    gqa_hf.check_key(hf, "hidden_act", "silu", "silu", where)
    gqa_hf.check_key(hf, "attention_bias", False, False, where)
    gqa_hf.check_key(hf, "clip_qkv", None, None, where)
    return {
        **gqa_hf.from_hf_common(hf, None, 1e-5),
        **moe.from_hf(hf, "intermediate_size"),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.01)),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        **rope_from_hf(hf, where),
    }


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type
    return gqa_hf.to_hf_common(model) | moe.to_hf(model, "intermediate_size") | {
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(model),
        "attention_bias": False,
        "clip_qkv": None,
        "norm_topk_prob": model["norm_topk_prob"],
    }  # fmt: skip


def tensors(model: dict[str, Any], experts: list[HFTensor]) -> list[HFTensor]:
    """The checkpoint's tensors around the ``experts``' (one layout of :mod:`~theseus.model.moe`)."""
    _, n_q, n_kv = gqa_hf.widths(model)
    norms = {"self_attn.q_norm": (n_q,), "self_attn.k_norm": (n_kv,)}  # over all heads
    return gqa_hf.checkpoint_tensors(model, moe.layer_shapes(model) | norms, experts)


FAMILY = moe.family(
    name="olmoe",
    config_class=OlmoeConfig,
    model_class=Olmoe,
    num_params=num_params,
    hf=HFSpec(
        architectures={"olmoe": "OlmoeForCausalLM"},
        from_hf=from_hf,
        export_type=lambda model, imported: "olmoe",
        to_hf=to_hf,
        **moe.tensor_layouts(tensors),
    ),
    descriptions={
        "train/pretrain": "train an OLMoE decoder (mixture of experts) on byte or token data",
        "evaluate": "validation loss of the latest OLMoE checkpoint of a run",
    },
)
