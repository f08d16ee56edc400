"""The Mixtral family: Mistral AI's Mixtral 8x7B and 8x22B (``model_type`` ``mixtral``).

Mistral's layer (rotary grouped-query attention over a sliding window on every layer when
``sliding_window`` is set) with an expert block in place of the MLP: a softmax router over
``num_local_experts`` experts, the ``num_experts_per_tok`` best renormalised to sum to 1 (equal
to a softmax over the chosen logits), each a SwiGLU MLP ``intermediate_size`` wide, stored as
Hugging Face's ``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up) and ``w2`` (down)
(:mod:`theseus.model.experts`). Training adds ``router_aux_loss_coef`` times the load-balancing
loss. Weights are stored as Hugging Face stores them, ``(d_out, d_in)``, stacked along
``n_layer`` (and ``n_expert``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from theseus.model import gqa, gqa_hf, moe
from theseus.model.decoder import LayerInputs, LayerOutput, PerLayer
from theseus.model.experts import Experts
from theseus.model.family import HFSpec, HFTensor
from theseus.model.moe import MoEConfig, MoESettings
from theseus.model.parts import RMSNorm, weights
from theseus.model.rotary import rope_from_hf, rope_to_hf

#: Hugging Face's names of an expert's gate, up and down matrices.
EXPERT_NAMES = ("w1", "w3", "w2")


class MixtralConfig(MoEConfig):
    """Hyperparameters of a Mixtral decoder (the names of Hugging Face's config: each expert's
    width is ``moe_intermediate_size``, Hugging Face's ``intermediate_size``; ``num_experts``
    its ``num_local_experts``). A window (``sliding_window``) applies to every layer."""


@weights
class Layer(gqa.Attention):
    """A Mixtral layer's weights: attention, the two norms, the expert block ``mlp``."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp: Experts


def block(layer: Layer, x: jax.Array, inputs: LayerInputs, s: MoESettings) -> LayerOutput:
    """One pre-RMSNorm layer on the float32 stream ``x`` (batch, seq, n_embd): rotary attention,
    then the expert block."""
    h = layer.input_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
    attended = gqa.self_attention(layer, h, inputs, inputs.features, s.head_dim)
    x, routing = moe.expert_sublayer(layer, x + attended.output.astype(jnp.float32), s)
    return LayerOutput(x, attended.cache, routing)


def skeleton(c: MixtralConfig, compute_dtype: DTypeLike, remat: bool | str = False):
    sk = gqa.rotary_skeleton(c, compute_dtype, remat, layer=block)
    return moe.routed(replace(sk, per_layer=PerLayer(windows=c.windows)), c)


class Mixtral(gqa.Model):
    """A Mixtral decoder (see the module docstring). State paths are Hugging Face's names,
    layers stacked: ``embed_tokens``, ``norm/weight``, ``lm_head``; under ``layers/``: the
    norms, ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and the expert block ``mlp``."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: MixtralConfig, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)
        rms = gqa.rms_norms(c, rngs)
        self.layers = Layer(
            input_layernorm=rms(c.hidden_size),
            **gqa.attention_projections(c, rngs),
            post_attention_layernorm=rms(c.hidden_size),
            mlp=moe.expert_block(c, True, rngs),  # Mixtral always renormalises
        )
        gqa.add_head(self, c, rngs)


def num_params(c: MixtralConfig) -> int:
    """The exact number of parameters of ``Mixtral(c)``."""
    attention = moe.attention_params(c, 0)  # no q/k norms
    return c.num_layers * attention + moe.expert_params(c) + c.table_params


# --- Hugging Face: MixtralForCausalLM ----------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of a Mixtral ``config.json``."""
    del model_type
    gqa_hf.check_key(hf, "hidden_act", "silu", "silu", where)
    gqa_hf.check_key(hf, "router_jitter_noise", 0.0, 0.0, where)
    return {
        **gqa_hf.from_hf_common(hf, None, 1e-5),
        **moe.from_hf(hf, "intermediate_size"),
        "sliding_window": hf.get("sliding_window"),
        **rope_from_hf(hf, where),
    }


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type
    experts = moe.to_hf(model, "intermediate_size")
    experts["num_local_experts"] = experts.pop("num_experts")  # Mixtral's name
    return gqa_hf.to_hf_common(model) | experts | {
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(model),
        "sliding_window": model.get("sliding_window"),
    }  # fmt: skip


def tensors(model: dict[str, Any], experts: list[HFTensor]) -> list[HFTensor]:
    """The checkpoint's tensors around the ``experts``' (one layout of :mod:`~theseus.model.moe`)."""
    return gqa_hf.checkpoint_tensors(model, moe.layer_shapes(model), experts)


FAMILY = moe.family(
    name="mixtral",
    config_class=MixtralConfig,
    model_class=Mixtral,
    num_params=num_params,
    hf=HFSpec(
        architectures={"mixtral": "MixtralForCausalLM"},
        from_hf=from_hf,
        export_type=lambda model, imported: "mixtral",
        to_hf=to_hf,
        **moe.tensor_layouts(tensors, "block_sparse_moe", EXPERT_NAMES),
    ),
    descriptions={
        "train/pretrain": "train a Mixtral decoder (mixture of experts) on byte or token data",
        "evaluate": "validation loss of the latest Mixtral checkpoint of a run",
    },
)
