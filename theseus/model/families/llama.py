"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 and Qwen3 decoders.

RMSNorm, rotary embeddings (``rope_theta``, optionally Llama 3.1's frequency-dependent scaling),
grouped-query attention (over a sliding window on every layer, Mistral, or on some, Qwen2's
``use_sliding_window``), a SwiGLU MLP, a tied or untied head, optional q/k/v biases (Qwen2) and
optional per-head q/k RMSNorm with its own ``head_dim`` (Qwen3). Weights are stored as Hugging
Face stores them, ``(d_out, d_in)``, stacked along ``n_layer``, and q/k keep Hugging Face's head
layout, so checkpoints import and export without permuting anything.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from theseus.model import gqa, gqa_hf
from theseus.model import windows as sliding
from theseus.model.decoder import LayerInputs, LayerOutput, PerLayer
from theseus.model.family import HFSpec, HFTensor, whole
from theseus.model.gqa import Settings, WindowedConfig, field
from theseus.model.parts import RMSNorm, weights
from theseus.model.rotary import rope_from_hf, rope_to_hf


class LlamaConfig(WindowedConfig):
    """Hyperparameters of a Llama-family decoder (the names of Hugging Face's configs).

    ``head_dim`` None means hidden_size / num_heads (Qwen3 sets its own). Windows as
    :class:`~theseus.model.gqa.WindowedConfig` (Mistral: every layer; Qwen2/3: some).
    """

    attention_bias: bool = field(False, "q/k/v projection biases")
    qk_norm: bool = field(False, "per-head q/k RMSNorm")


@weights
class Layer(gqa.Attention, gqa.MLP):
    """A Llama-family layer's weights: attention (q/k norms with qk_norm), norms, the MLP."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm


def block(layer: Layer, x: jax.Array, inputs: LayerInputs, s: Settings) -> LayerOutput:
    """One pre-RMSNorm layer on the float32 stream ``x`` (batch, seq, n_embd): attention with
    per-head q/k norms (when the layer has them) and rotary q/k, then the SwiGLU MLP."""
    h = layer.input_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
    attended = gqa.self_attention(layer, h, inputs, inputs.features, s.head_dim)
    x = x + attended.output.astype(jnp.float32)
    h = layer.post_attention_layernorm(x, s.compute_dtype)
    return LayerOutput(x + gqa.gated_mlp(layer, h, jax.nn.silu).astype(jnp.float32), attended.cache)


def skeleton(c: LlamaConfig, compute_dtype: DTypeLike, remat: bool | str = False):
    sk = gqa.rotary_skeleton(c, compute_dtype, remat, layer=block)
    return replace(sk, per_layer=PerLayer(windows=c.windows))


class Llama(gqa.Model):
    """A Llama-family decoder (see the module docstring). State paths are Hugging Face's names,
    layers stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` unless tied; under
    ``layers/``: the norms, ``q_proj`` (n_layer, n_q, n_embd), ``k_proj``/``v_proj`` (n_layer,
    n_kv, n_embd), ``o_proj``, ``q_norm``/``k_norm`` (with qk_norm) and the MLP's projections."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)
        rms = gqa.rms_norms(c, rngs)
        self.layers = Layer(
            input_layernorm=rms(c.hidden_size),
            **gqa.attention_projections(c, rngs, c.attention_bias, rms if c.qk_norm else None),
            post_attention_layernorm=rms(c.hidden_size),
            **gqa.mlp_projections(c, rngs),
        )
        gqa.add_head(self, c, rngs)


def num_params(c: LlamaConfig) -> int:
    """The exact number of parameters of ``Llama(c)``."""
    biases = (c.n_q + 2 * c.n_kv) if c.attention_bias else 0
    qk_norms = 2 * c.dim_per_head if c.qk_norm else 0
    per_layer = c.projection_params + biases + qk_norms + 2 * c.hidden_size
    return c.num_layers * per_layer + c.table_params


# --- Hugging Face: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM ----


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of a Llama, Mistral, Qwen2 or Qwen3 ``config.json``."""
    gqa_hf.check_key(hf, "hidden_act", "silu", "silu", where)
    gqa_hf.check_key(hf, "mlp_bias", False, False, where)
    default_head_dim = 128 if model_type == "qwen3" else None
    return {
        **gqa_hf.from_hf_common(hf, default_head_dim, 1e-6),
        "attention_bias": model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        "qk_norm": model_type == "qwen3",
        **sliding.windows_from_hf(hf, model_type, where),
        **rope_from_hf(hf, where),
    }


def export_type(model: dict[str, Any], imported: str | None) -> str:
    """The imported type when it can express the model, else the plainest that can (llama,
    mistral for a window on every layer, qwen2 for biases, qwen3 for q/k norms)."""
    if model["qk_norm"]:
        return "qwen3"
    if imported == "qwen2" and model["attention_bias"]:
        return "qwen2"
    windowed = model.get("sliding_window") is not None
    every_layer = model.get("layer_types") is None
    if (imported == "mistral" or windowed) and every_layer and not model["attention_bias"]:
        return "mistral"
    if windowed and model["attention_bias"]:
        return "qwen2"
    if windowed:
        raise ValueError(
            "model.layer_types mixes sliding and full layers, which only qwen2 (with "
            "attention_bias) and qwen3 (with qk_norm) write; this model has neither"
        )
    return "llama"


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    rope = {"rope_parameters": rope_to_hf(model)}
    config = gqa_hf.to_hf_common(model) | {"hidden_act": "silu"} | rope
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = model["attention_bias"]
    if model_type in ("qwen2", "qwen3"):
        config |= sliding.windows_to_hf(model)
    if model_type == "mistral":
        config["sliding_window"] = model.get("sliding_window")
    return config


def tensors(model: dict[str, Any]) -> list[HFTensor]:
    e = model["hidden_size"]
    head_dim, n_q, n_kv = gqa_hf.widths(model)
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm": (e,), "post_attention_layernorm": (e,)}
    shapes |= gqa_hf.projection_shapes(model)
    if model["qk_norm"]:
        shapes |= {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}
    biases = [
        whole(f"model.layers.{layer}.self_attn.{x}_proj.bias", (width,), f"layers/{x}_proj/bias", layer)
        for layer in range(model["num_layers"]) if model["attention_bias"]
        for x, width in (("q", n_q), ("k", n_kv), ("v", n_kv))
    ]  # fmt: skip
    return gqa_hf.checkpoint_tensors(model, shapes, biases)


FAMILY = gqa.family(
    name="llama",
    config_class=LlamaConfig,
    model_class=Llama,
    num_params=num_params,
    hf=HFSpec(
        architectures={
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        },
        from_hf=from_hf,
        export_type=export_type,
        to_hf=to_hf,
        tensors=tensors,
        peft_targets=gqa.PEFT_TARGETS,
    ),
    descriptions={
        "train/pretrain": "train a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on byte "
        "or token data",
        "evaluate": "validation loss of the latest Llama-family checkpoint of a run",
    },
)
