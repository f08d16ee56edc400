"""The Gemma family: Google's Gemma 2 and Gemma 3 text decoders (``model_type`` ``gemma2``,
``gemma3_text``, and the language model of a ``gemma3`` folder as transformers lays it out).

RMSNorm scaled by ``1 + weight`` (its weights start at zero), embeddings multiplied by
sqrt(hidden_size) (rounded to the compute dtype, as transformers rounds it to the model's), a
GeGLU MLP (tanh GELU), a norm before *and* after both attention and the MLP, attention scores
scaled by ``query_pre_attn_scalar ** -0.5``, a tied head, ``head_dim`` apart from the width.
Gemma 2 soft-caps the attention scores and the logits; Gemma 3 norms q and k per head. Layers
differ: the sliding ones (``layer_types``) read a window and, in Gemma 3, rotate with their own
base (``rope_local_base_freq``, unscaled) while the global ones take ``rope_theta`` and its
scaling. Windows and rotary frequencies travel through the layer scan as layer-indexed data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.model import gqa, gqa_hf
from theseus.model import windows as sliding
from theseus.model.decoder import LayerInputs, LayerOutput, PerLayer, Weights
from theseus.model.family import HFSpec, HFTensor
from theseus.model.gqa import WindowedConfig, field
from theseus.model.parts import RMSNorm, weights
from theseus.model.rotary import (
    inverse_frequencies,
    rope_from_hf,
    rope_settings,
    rope_to_hf,
    rotary,
)


class GemmaConfig(WindowedConfig):
    """Hyperparameters of a Gemma 2 or Gemma 3 text decoder (the names of Hugging Face's
    configs; see :class:`~theseus.model.gqa.GQAConfig`). ``rope_theta`` and the rotary scaling
    are the global layers'; ``rope_local_base_freq`` (Gemma 3) the sliding layers' base, None:
    they rotate as the global ones. Windows as :class:`~theseus.model.gqa.WindowedConfig`."""

    tie_word_embeddings: bool = field(True, "output head = embedding")
    query_pre_attn_scalar: pydantic.StrictInt = field(
        256, "attention scores × its -1/2 power", gt=0
    )
    attn_logit_softcapping: float | None = field(None, "attention score cap; None: none", gt=0)
    final_logit_softcapping: float | None = field(None, "logit cap; None: none", gt=0)
    qk_norm: bool = field(False, "per-head q/k RMSNorm (Gemma 3)")
    rope_local_base_freq: float | None = field(
        None, "rotary base of the sliding layers (unscaled); None: as the global layers", gt=0
    )

    @property
    def inv_freqs(self) -> tuple[tuple[float, ...], ...]:
        """Each layer's rotary inverse frequencies: the global ones, or on sliding layers the
        local base's when there is one."""
        rope = dict(self)
        local = rope | {"rope_theta": self.rope_local_base_freq, "rope_type": "default"}
        kinds = [rope if w is None or self.rope_local_base_freq is None else local
                 for w in self.windows]  # fmt: skip
        return tuple(
            tuple(float(f) for f in inverse_frequencies(self.dim_per_head, kind)) for kind in kinds
        )


@dataclass(frozen=True)
class Settings:
    """What a Gemma layer and its embedding read besides their weights."""

    head_dim: int
    embed_scale: float  # sqrt(hidden_size) rounded to the compute dtype
    compute_dtype: jnp.dtype


@weights
class Layer(gqa.Attention, gqa.MLP, gqa.OutputNorms):
    """A Gemma layer's weights: a norm before and after both attention and the MLP."""

    input_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm


def embed(w: Weights, tokens: jax.Array, positions: jax.Array, s: Settings) -> jax.Array:
    del positions  # they enter through each layer's rotary angles
    return w.table[tokens].astype(jnp.float32) * s.embed_scale  # (batch, seq, n_embd)


def features(positions: jax.Array, s: Settings) -> jax.Array:
    del s
    return positions  # each layer rotates with its own frequencies


def block(layer: Layer, x: jax.Array, inputs: LayerInputs, s: Settings) -> LayerOutput:
    """One layer on the float32 stream ``x`` (batch, seq, n_embd): normed attention (per-head
    q/k norms when the layer has them, the layer's rotary angles), its output normed and added;
    the GeGLU MLP likewise. Gemma's norms scale by ``1 + weight`` (``RMSNorm.offset``)."""
    rotation = rotary(inputs.features, inputs.data.inv_freq)  # cos, sin (batch or 1, seq, hd)
    h = layer.input_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
    attended = gqa.self_attention(layer, h, inputs, rotation, s.head_dim)
    x = x + layer.post_attention_layernorm(attended.output, jnp.float32)
    h = layer.pre_feedforward_layernorm(x, s.compute_dtype)
    out = gqa.gated_mlp(layer, h, partial(jax.nn.gelu, approximate=True))  # (.., n_embd)
    x = x + layer.post_feedforward_layernorm(out, jnp.float32)
    return LayerOutput(x, attended.cache)


def skeleton(c: GemmaConfig, compute_dtype: DTypeLike, remat: bool | str = False):
    sk = gqa.rotary_skeleton(c, compute_dtype, remat, layer=block)
    scale = float(np.asarray(math.sqrt(c.hidden_size), sk.compute_dtype))
    return replace(
        sk,
        embed=embed,
        features=features,
        settings=Settings(c.dim_per_head, scale, sk.compute_dtype),
        per_layer=PerLayer(windows=c.windows, inv_freqs=c.inv_freqs),
        attention=replace(
            sk.attention, scale=c.query_pre_attn_scalar**-0.5, softcap=c.attn_logit_softcapping
        ),
        logit_softcap=c.final_logit_softcapping,
    )


class Gemma(gqa.Model):
    """A Gemma 2 or 3 decoder (see the module docstring). State paths are Hugging Face's names,
    layers stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` when untied; under
    ``layers/``: the four norms, ``q_proj`` (n_layer, n_q, n_embd), ``k_proj``/``v_proj``
    (n_layer, n_kv, n_embd), ``o_proj``, ``q_norm``/``k_norm`` (qk_norm) and the MLP's."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: GemmaConfig, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)
        norm = gqa.rms_norms(c, rngs, offset=1.0)  # weights start at 0: a scale of 1
        self.layers = Layer(
            input_layernorm=norm(c.hidden_size),
            **gqa.attention_projections(c, rngs, head_norm=norm if c.qk_norm else None),
            post_attention_layernorm=norm(c.hidden_size),
            pre_feedforward_layernorm=norm(c.hidden_size),
            **gqa.mlp_projections(c, rngs),
            post_feedforward_layernorm=norm(c.hidden_size),
        )
        gqa.add_head(self, c, rngs, offset=1.0)


def num_params(c: GemmaConfig) -> int:
    """The exact number of parameters of ``Gemma(c)``."""
    qk_norms = 2 * c.dim_per_head if c.qk_norm else 0
    per_layer = c.projection_params + qk_norms + 4 * c.hidden_size
    return c.num_layers * per_layer + c.table_params


# --- Hugging Face: Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration's text -

# What transformers assumes where a key is absent (its config classes' defaults): published
# gemma3 folders leave most of text_config to them.
_SHAPES = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": _SHAPES | dict(vocab_size=256000, max_position_embeddings=8192,
                             attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": _SHAPES | dict(vocab_size=262208, max_position_embeddings=131072,
                                  attn_logit_softcapping=None, final_logit_softcapping=None),
}  # fmt: skip
_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # 4.x: every pattern-th layer is global


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of a Gemma 2 or Gemma 3 text ``config.json`` (a ``gemma3`` one's
    ``text_config``)."""
    if model_type == "gemma3":
        hf, model_type, where = hf["text_config"], "gemma3_text", f"{where} (text_config)"
    hf = _HF_DEFAULTS[model_type] | hf
    gqa_hf.check_key(hf, "hidden_activation", "gelu_pytorch_tanh", "gelu_pytorch_tanh", where)
    gqa_hf.check_key(hf, "attention_bias", False, False, where)
    gqa_hf.check_key(hf, "use_bidirectional_attention", False, False, where)
    pattern = hf.get("sliding_window_pattern") or _PATTERN[model_type]
    every = range(hf["num_hidden_layers"])
    types = hf.get("layer_types") or [sliding.KINDS[(i + 1) % pattern > 0] for i in every]
    unknown = sorted(set(types) - set(sliding.KINDS))
    if unknown:
        raise ValueError(
            f"{where}: layer_types holds {unknown}; theseus has full_attention and "
            "sliding_attention layers"
        )
    window = hf["sliding_window"] if "sliding_attention" in types else None
    model = gqa_hf.from_hf_common(hf, None, 1e-6) | {
        "query_pre_attn_scalar": int(hf["query_pre_attn_scalar"]),
        "attn_logit_softcapping": hf["attn_logit_softcapping"],
        "final_logit_softcapping": hf["final_logit_softcapping"],
        "qk_norm": model_type == "gemma3_text",
        "sliding_window": window,
        "layer_types": list(types) if window is not None else None,
    }
    return model | (rope_from_hf(hf, where) if model_type == "gemma2" else _gemma3_rope(hf, where))


def _gemma3_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 3's rotary settings: 5.x's ``rope_parameters`` per layer type, or 4.x's
    ``rope_theta``, ``rope_scaling`` (the global layers') and ``rope_local_base_freq``."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5.x
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        rope = rope_settings(full, full.get("rope_theta", 1e6), where)
        if rope_settings(local, 1.0, where)["rope_type"] != "default":
            raise ValueError(
                f"{where}: rope_parameters.sliding_attention scales the sliding layers' "
                "rotary frequencies; theseus scales the global layers' only (as Gemma 3 does)"
            )
        return rope | {"rope_local_base_freq": float(local.get("rope_theta", 1e4))}
    rope = rope_settings(hf.get("rope_scaling") or {}, hf.get("rope_theta", 1e6), where)
    return rope | {"rope_local_base_freq": float(hf.get("rope_local_base_freq", 1e4))}


def export_type(model: dict[str, Any], imported: str | None) -> str:
    """gemma3_text for q/k norms (a gemma3 folder's text too), else gemma2."""
    del imported  # the model says which
    if model["qk_norm"]:
        return "gemma3_text"
    local = model.get("rope_local_base_freq")
    if local is not None and local != model["rope_theta"]:
        raise ValueError(
            "model.rope_local_base_freq differs from model.rope_theta but model.qk_norm is "
            "false: gemma3_text (which has q/k norms) writes a local base, gemma2 does not"
        )
    return "gemma2"


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    window, rope = model.get("sliding_window"), rope_to_hf(model)
    types = model.get("layer_types") or [sliding.KINDS[window is not None]] * model["num_layers"]
    if model_type == "gemma3_text":
        local = model.get("rope_local_base_freq")  # None: the sliding layers rotate as global
        unscaled = {"rope_type": "default", "rope_theta": local}
        rope = {"full_attention": rope, "sliding_attention": rope if local is None else unscaled}
    return gqa_hf.to_hf_common(model) | {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": model["query_pre_attn_scalar"],
        "attn_logit_softcapping": model["attn_logit_softcapping"],
        "final_logit_softcapping": model["final_logit_softcapping"],
        "sliding_window": window,
        "layer_types": list(types),
        "rope_parameters": rope,
    }


def tensors(model: dict[str, Any]) -> list[HFTensor]:
    e = model["hidden_size"]
    head_dim, _, _ = gqa_hf.widths(model)
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm": (e,), "post_attention_layernorm": (e,)}
    shapes |= {"pre_feedforward_layernorm": (e,), "post_feedforward_layernorm": (e,)}
    shapes |= gqa_hf.projection_shapes(model)
    if model["qk_norm"]:
        shapes |= {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}
    return gqa_hf.checkpoint_tensors(model, shapes)


def aliases(name: str) -> tuple[str, ...]:
    """A tensor's name in a text checkpoint and in a ``gemma3`` folder, as transformers 5.x
    (``model.language_model.``) and 4.x (``language_model.model.``) save one."""
    if name.startswith("model."):
        rest = name.removeprefix("model.")
        return name, f"model.language_model.{rest}", f"language_model.model.{rest}"
    return name, f"language_model.{name}"


FAMILY = gqa.family(
    name="gemma",
    config_class=GemmaConfig,
    model_class=Gemma,
    num_params=num_params,
    hf=HFSpec(
        architectures={
            "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM",
            "gemma3": "Gemma3ForConditionalGeneration",
        },
        from_hf=from_hf,
        export_type=export_type,
        to_hf=to_hf,
        tensors=tensors,
        peft_targets=gqa.PEFT_TARGETS,
        aliases=aliases,
        unread=("vision_tower.", "multi_modal_projector."),  # a gemma3 folder's image side
    ),
    descriptions={
        "train/pretrain": "train a Gemma 2 or Gemma 3 (text) decoder on byte or token data",
        "evaluate": "validation loss of the latest Gemma checkpoint of a run",
    },
)
