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

from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.model import gqa
from theseus.model.decoder import DecoderModel, LayerInputs
from theseus.model.family import HFSpec, HFTensor
from theseus.model.gqa import GQAConfig, Settings, field
from theseus.model.parts import Norm, Stack, norm, project
from theseus.model.rotary import apply_rotary, rope_from_hf, rope_to_hf


class Olmo2Config(GQAConfig):
    """Hyperparameters of an OLMo 2 decoder (the names of Hugging Face's config; see
    :class:`~theseus.model.gqa.GQAConfig`)."""

    num_kv_heads: pydantic.StrictInt = field(4, "key/value heads", gt=0)
    rope_theta: float = field(500000.0, "rotary base", gt=0)


def block(layer: dict, x: jax.Array, inputs: LayerInputs, s: Settings) -> jax.Array:
    """One layer on the float32 stream ``x`` (batch, seq, n_embd): attention with q/k normed
    over all heads then rotated, its output normed and added; the SwiGLU MLP likewise."""
    batch, seq, _ = x.shape
    cos, sin = inputs.features
    h = x.astype(s.compute_dtype)  # no pre-norm
    q = norm(project(h, layer["q_proj"]), layer["q_norm"], s.eps, s.compute_dtype)  # n_q
    k = norm(project(h, layer["k_proj"]), layer["k_norm"], s.eps, s.compute_dtype)  # n_kv
    v = project(h, layer["v_proj"])  # (batch, seq, n_kv)
    q, k, v = (t.reshape(batch, seq, -1, s.head_dim) for t in (q, k, v))  # (.., heads, head_dim)
    attended = inputs.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
    out = project(attended.reshape(batch, seq, -1), layer["o_proj"])  # (batch, seq, n_embd)
    x = x + norm(out, layer["post_attention_layernorm"], s.eps, jnp.float32)
    h = x.astype(s.compute_dtype)
    gated = jax.nn.silu(project(h, layer["gate_proj"])) * project(h, layer["up_proj"])  # n_mlp
    out = project(gated, layer["down_proj"])  # (batch, seq, n_embd)
    return x + norm(out, layer["post_feedforward_layernorm"], s.eps, jnp.float32)


def skeleton(c: Olmo2Config, compute_dtype: DTypeLike, remat: bool | str = False, lora_scale=0.0):
    return gqa.rotary_skeleton(c, block, compute_dtype, remat, lora_scale)


class Olmo2(DecoderModel):
    """An OLMo 2 decoder (see the module docstring). State paths are Hugging Face's names, layers
    stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` unless tied; under ``layers/``:
    ``q_proj`` (n_layer, n_q, n_embd), ``k_proj``/``v_proj`` (n_layer, n_kv, n_embd),
    ``o_proj``, ``q_norm`` (n_layer, n_q), ``k_norm`` (n_layer, n_kv), the MLP's projections
    and the two output norms."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: Olmo2Config, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)

        def rms(dim, name=None):
            return Norm((c.num_layers, dim), ("n_layer", name), kind="rms", rngs=rngs)

        layers = gqa.attention_projections(c, rngs)
        layers |= {"q_norm": rms(c.n_q, "n_q"), "k_norm": rms(c.n_kv, "n_kv")}
        layers["post_attention_layernorm"] = rms(c.hidden_size)
        layers |= gqa.mlp_projections(c, rngs)
        layers["post_feedforward_layernorm"] = rms(c.hidden_size)
        self.layers = Stack(layers)
        gqa.add_head(self, c, Norm((c.hidden_size,), (None,), kind="rms", rngs=rngs), rngs)


def num_params(c: Olmo2Config) -> int:
    """The exact number of parameters of ``Olmo2(c)``."""
    per_layer = c.projection_params + c.n_q + c.n_kv + 2 * c.hidden_size  # q/k and output norms
    return c.num_layers * per_layer + c.table_params


# --- Hugging Face: Olmo2ForCausalLM -------------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of an OLMo 2 ``config.json``."""
    del model_type  # olmo2 only
    gqa.check_key(hf, "hidden_act", "silu", "silu", where)
    gqa.check_key(hf, "attention_bias", False, False, where)
    return gqa.from_hf_common(hf, None, 1e-5) | rope_from_hf(hf, where)


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type  # olmo2 only
    rope = {"rope_parameters": rope_to_hf(model)}
    return gqa.to_hf_common(model) | {"attention_bias": False, "hidden_act": "silu"} | rope


def tensors(model: dict[str, Any]) -> list[HFTensor]:
    e = model["hidden_size"]
    _, n_q, n_kv = gqa.widths(model)
    shapes: dict[str, tuple[int, ...]] = {"self_attn.q_norm": (n_q,), "self_attn.k_norm": (n_kv,)}
    shapes |= {"post_attention_layernorm": (e,), "post_feedforward_layernorm": (e,)}
    return gqa.checkpoint_tensors(model, shapes | gqa.projection_shapes(model))


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
