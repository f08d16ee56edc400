"""The OLMo 2 family: AI2's OLMo 2 decoders (``model_type`` ``olmo2``).

Llama's pieces in another order: no norm before attention or the MLP; instead RMSNorm of each
sublayer's output before it is added to the residual stream (``post_attention_layernorm``,
``post_feedforward_layernorm``), and RMSNorm of the whole query and key projections (``q_norm``
n_q wide, ``k_norm`` n_kv wide, not per head) before the rotary embedding. Grouped-query
attention, a SwiGLU MLP, an untied head (a tied one is read too). Weights are stored as Hugging
Face stores them, ``(d_out, d_in)``, stacked along ``n_layer``, so checkpoints import and export
without permuting anything. TP splits the q/k norms' weights with their projections (their
statistics then sum over ``shard``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

from theseus.model import gqa, gqa_hf
from theseus.model.decoder import LayerInputs, LayerOutput
from theseus.model.family import HFSpec, HFTensor
from theseus.model.gqa import GQAConfig, Settings, field
from theseus.model.parts import weights
from theseus.model.rotary import rope_from_hf, rope_to_hf


class Olmo2Config(GQAConfig):
    """Hyperparameters of an OLMo 2 decoder (the names of Hugging Face's config; see
    :class:`~theseus.model.gqa.GQAConfig`)."""

    num_kv_heads: pydantic.StrictInt = field(4, "key/value heads", gt=0)
    rope_theta: float = field(500000.0, "rotary base", gt=0)


@weights
class Layer(gqa.WholeNormedAttention, gqa.MLP, gqa.OutputNorms):
    """An OLMo 2 layer's weights: q/k norms over all heads, each sublayer's output normed."""


def block(layer: Layer, x: jax.Array, inputs: LayerInputs, s: Settings) -> LayerOutput:
    """One layer on the float32 stream ``x`` (batch, seq, n_embd): attention with q/k normed
    over all heads then rotated, its output normed and added; the SwiGLU MLP likewise."""
    h = x.astype(s.compute_dtype)  # no pre-norm
    attended = gqa.whole_normed_attention(layer, h, inputs, inputs.features, s.head_dim)
    x = x + layer.post_attention_layernorm(attended.output, jnp.float32)
    out = gqa.gated_mlp(layer, x.astype(s.compute_dtype), jax.nn.silu)  # (batch, seq, n_embd)
    x = x + layer.post_feedforward_layernorm(out, jnp.float32)
    return LayerOutput(x, attended.cache)


class Olmo2(gqa.Model):
    """An OLMo 2 decoder (see the module docstring). State paths are Hugging Face's names, layers
    stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` unless tied; under ``layers/``:
    ``q_proj`` (n_layer, n_q, n_embd), ``k_proj``/``v_proj`` (n_layer, n_kv, n_embd),
    ``o_proj``, ``q_norm`` (n_layer, n_q), ``k_norm`` (n_layer, n_kv), the MLP's projections
    and the two output norms."""

    skeleton_of = staticmethod(partial(gqa.rotary_skeleton, layer=block))

    def build(self, c: Olmo2Config, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)
        rms = gqa.rms_norms(c, rngs)
        self.layers = Layer(
            **gqa.whole_normed_projections(c, rngs),
            post_attention_layernorm=rms(c.hidden_size),
            **gqa.mlp_projections(c, rngs),
            post_feedforward_layernorm=rms(c.hidden_size),
        )
        gqa.add_head(self, c, rngs)


def num_params(c: Olmo2Config) -> int:
    """The exact number of parameters of ``Olmo2(c)``."""
    per_layer = c.projection_params + c.n_q + c.n_kv + 2 * c.hidden_size  # q/k and output norms
    return c.num_layers * per_layer + c.table_params


# --- Hugging Face: Olmo2ForCausalLM -------------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of an OLMo 2 ``config.json``."""
    del model_type  # olmo2 only
    gqa_hf.check_key(hf, "hidden_act", "silu", "silu", where)
    gqa_hf.check_key(hf, "attention_bias", False, False, where)
    return gqa_hf.from_hf_common(hf, None, 1e-5) | rope_from_hf(hf, where)


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type  # olmo2 only
    rope = {"rope_parameters": rope_to_hf(model)}
    return gqa_hf.to_hf_common(model) | {"attention_bias": False, "hidden_act": "silu"} | rope


def tensors(model: dict[str, Any]) -> list[HFTensor]:
    e = model["hidden_size"]
    _, n_q, n_kv = gqa_hf.widths(model)
    shapes: dict[str, tuple[int, ...]] = {"self_attn.q_norm": (n_q,), "self_attn.k_norm": (n_kv,)}
    shapes |= {"post_attention_layernorm": (e,), "post_feedforward_layernorm": (e,)}
    return gqa_hf.checkpoint_tensors(model, shapes | gqa_hf.projection_shapes(model))


FAMILY = gqa.family(
    name="olmo2",
    config_class=Olmo2Config,
    model_class=Olmo2,
    num_params=num_params,
    hf=HFSpec(
        architectures={"olmo2": "Olmo2ForCausalLM"},
        from_hf=from_hf,
        export_type=lambda model, imported: "olmo2",
        to_hf=to_hf,
        tensors=tensors,
        peft_targets=gqa.PEFT_TARGETS,
    ),
    descriptions={
        "train/pretrain": "train an OLMo 2 decoder on byte or token data",
        "evaluate": "validation loss of the latest OLMo 2 checkpoint of a run",
    },
)
