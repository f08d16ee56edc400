"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 and Qwen3 decoders.

RMSNorm, rotary embeddings (``rope_theta``, optionally Llama 3.1's frequency-dependent scaling),
grouped-query attention (over a sliding window on every layer, Mistral, or on some, Qwen2's
``use_sliding_window``), a SwiGLU MLP, a tied or untied head, optional q/k/v biases (Qwen2) and
optional per-head q/k RMSNorm with its own ``head_dim`` (Qwen3). Weights are stored as Hugging
Face stores them, ``(d_out, d_in)``, stacked along ``n_layer``, and q/k keep Hugging Face's head
layout, so checkpoints import and export without permuting anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.config import Section
from theseus.model import windows as sliding
from theseus.model.decoder import CachedDecoder, DecoderModel, LayerInputs, Paths, Skeleton
from theseus.model.family import Context, Family, HFSpec, HFTensor, Matmuls, whole
from theseus.model.parts import Norm, Stack, StackedProjection, norm, param, project
from theseus.model.rotary import apply_rotary, inverse_frequencies, rope_from_hf, rope_to_hf, rotary
from theseus.sharding.axis import Axis, ShardingPlan

# TP splits the query heads (n_q = num_heads × head_dim), the key/value heads (n_kv) and the MLP
# over `shard`; the residual width, vocabulary and layer count stay whole on each TP device.
# Heads are contiguous slices of n_q and n_kv, so each device holds whole heads when tp divides
# num_kv_heads (results are correct for any tp that divides the widths). ZeRO also partitions
# the vocabulary (embedding and head) over `batch`.
LLAMA_PLAN = ShardingPlan(
    tp=[
        ("n_q", Axis.SHARD),
        ("n_kv", Axis.SHARD),
        ("n_mlp", Axis.SHARD),
        ("vocab", None),
        ("n_embd", None),
        ("n_layer", None),
    ],
    zero=[
        ("n_q", Axis.BATCH),
        ("n_kv", Axis.BATCH),
        ("n_mlp", Axis.BATCH),
        ("vocab", Axis.BATCH),
    ],
)


def _field(default: Any, description: str, **limits: Any) -> Any:
    return pydantic.Field(default, description=description, **limits)


class LlamaConfig(Section):
    """Hyperparameters of a Llama-family decoder (the names of Hugging Face's configs).

    ``head_dim`` None means hidden_size / num_heads (Qwen3 sets its own). rope_type ``llama3``
    scales the rotary frequencies as Llama 3.1 does with the ``rope_*`` factors.
    ``sliding_window``: the attention window of the layers that slide (a query reads the
    ``sliding_window`` latest positions up to its own); ``layer_types`` says which layers do
    (Hugging Face's names; None: every layer, as Mistral's). Sequences may be longer than the
    window, in training and in decoding.
    """

    vocab_size: pydantic.StrictInt = _field(256, "token ids", gt=0)
    hidden_size: pydantic.StrictInt = _field(128, "residual width", gt=0)
    intermediate_size: pydantic.StrictInt = _field(352, "MLP width", gt=0)
    num_layers: pydantic.StrictInt = _field(4, "decoder layers", gt=0)
    num_heads: pydantic.StrictInt = _field(4, "query heads", gt=0)
    num_kv_heads: pydantic.StrictInt = _field(2, "key/value heads", gt=0)
    head_dim: pydantic.StrictInt | None = _field(
        None, "head width; None: hidden_size / num_heads", gt=0
    )
    max_position_embeddings: pydantic.StrictInt = _field(128, "context length", gt=0)
    rope_theta: float = _field(10000.0, "rotary base", gt=0)
    rope_type: Literal["default", "llama3"] = _field(
        "default", "rotary frequencies: plain, or Llama 3.1's scaling"
    )
    rope_factor: float = _field(8.0, "llama3: scaling factor", gt=0)
    rope_low_freq_factor: float = _field(1.0, "llama3: low factor", gt=0)
    rope_high_freq_factor: float = _field(4.0, "llama3: high factor", gt=0)
    rope_original_max_position_embeddings: pydantic.StrictInt = _field(
        8192, "llama3: original context length", gt=0
    )
    rms_norm_eps: float = _field(1e-6, "RMSNorm epsilon", gt=0)
    tie_word_embeddings: bool = _field(False, "output head = embedding")
    attention_bias: bool = _field(False, "q/k/v projection biases")
    qk_norm: bool = _field(False, "per-head q/k RMSNorm")
    sliding_window: pydantic.StrictInt | None = _field(
        None, "attention window of the sliding layers; None: whole context", gt=0
    )
    layer_types: tuple[sliding.LayerType, ...] | None = _field(
        None, "each layer's attention; None: every layer slides when sliding_window is set"
    )

    @pydantic.model_validator(mode="after")
    def _heads_fit(self) -> LlamaConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; set head_dim."
            )
        if self.dim_per_head % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.dim_per_head} must be even (rotary).")
        window, layers = self.sliding_window, self.num_layers
        sliding.check_layer_types("LlamaConfig", self.layer_types, layers, window)
        return self

    @property
    def context(self) -> Context:
        return Context(self.max_position_embeddings, "model.max_position_embeddings")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: the whole context)."""
        return sliding.layer_windows(self.layer_types, self.num_layers, self.sliding_window)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def n_q(self) -> int:
        """Width of the query projection (all heads)."""
        return self.num_heads * self.dim_per_head

    @property
    def n_kv(self) -> int:
        """Width of the key and of the value projection (all key/value heads)."""
        return self.num_kv_heads * self.dim_per_head


@dataclass(frozen=True)
class Settings:
    head_dim: int
    eps: float
    inv_freq: tuple[float, ...]
    compute_dtype: jnp.dtype


def embed(params: dict, tokens: jax.Array, positions: jax.Array, s: Settings) -> jax.Array:
    del positions, s  # positions enter through the rotary features
    return params["embed_tokens"][tokens].astype(jnp.float32)  # (batch, seq, n_embd)


def features(positions: jax.Array, s: Settings) -> tuple[jax.Array, jax.Array]:
    return rotary(positions, s.inv_freq)  # cos, sin (batch or 1, seq, head_dim)


def block(layer: dict, x: jax.Array, inputs: LayerInputs, s: Settings) -> jax.Array:
    """One pre-RMSNorm layer on the float32 stream ``x`` (batch, seq, n_embd): attention with
    per-head q/k norms (when the layer has them) and rotary q/k, then the SwiGLU MLP."""
    batch, seq, _ = x.shape
    cos, sin = inputs.features
    h = norm(x, layer["input_layernorm"], s.eps, s.compute_dtype)  # (batch, seq, n_embd)
    q, k, v = (
        project(h, layer[name]).reshape(batch, seq, -1, s.head_dim)
        for name in ("q_proj", "k_proj", "v_proj")
    )  # q (batch, seq, heads, head_dim); k, v (batch, seq, kv_heads, head_dim)
    if "q_norm" in layer:
        q = norm(q, layer["q_norm"], s.eps, q.dtype)
        k = norm(k, layer["k_norm"], s.eps, k.dtype)
    attended = inputs.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
    out = project(attended.reshape(batch, seq, -1), layer["o_proj"])  # (batch, seq, n_embd)
    x = x + out.astype(jnp.float32)
    h = norm(x, layer["post_attention_layernorm"], s.eps, s.compute_dtype)
    gated = jax.nn.silu(project(h, layer["gate_proj"])) * project(h, layer["up_proj"])  # n_mlp
    return x + project(gated, layer["down_proj"]).astype(jnp.float32)  # (batch, seq, n_embd)


def skeleton(c: LlamaConfig, compute_dtype: DTypeLike, remat: bool | str = False, lora_scale=0.0):
    dtype = jnp.dtype(compute_dtype)
    inv_freq = tuple(float(f) for f in inverse_frequencies(c.dim_per_head, dict(c)))
    settings = Settings(c.dim_per_head, c.rms_norm_eps, inv_freq, dtype)
    paths = Paths(embed="embed_tokens", layers="layers", final_norm="norm", head="lm_head")
    return Skeleton(
        embed=embed,
        features=features,
        layer=block,
        settings=settings,
        paths=paths,
        eps=c.rms_norm_eps,
        compute_dtype=dtype,
        context_len=c.max_position_embeddings,
        context_key="model.max_position_embeddings",
        remat=remat,
        lora_scale=lora_scale,
        windows=c.windows,
    )


class Llama(DecoderModel):
    """A Llama-family decoder (see the module docstring). State paths are Hugging Face's names,
    layers stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` unless tied; under
    ``layers/``: the norms, ``q_proj`` (n_layer, n_q, n_embd), ``k_proj``/``v_proj`` (n_layer,
    n_kv, n_embd), ``o_proj``, ``q_norm``/``k_norm`` (with qk_norm) and the MLP's projections."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: LlamaConfig, rngs: nnx.Rngs) -> None:
        normal = nnx.initializers.normal(0.02)
        table = (c.vocab_size, c.hidden_size)
        self.embed_tokens = param(rngs, table, ("vocab", "n_embd"), normal)
        n, e, mlp = c.num_layers, c.hidden_size, c.intermediate_size

        def proj(d_in, d_out, names, bias=False):
            return StackedProjection(n, d_in, d_out, names, "oi", bias=bias, std=0.02, rngs=rngs)

        def rms(dim):
            return Norm((n, dim), ("n_layer", None), kind="rms", rngs=rngs)

        layers = {
            "input_layernorm": rms(e),
            "q_proj": proj(e, c.n_q, ("n_embd", "n_q"), c.attention_bias),
            "k_proj": proj(e, c.n_kv, ("n_embd", "n_kv"), c.attention_bias),
            "v_proj": proj(e, c.n_kv, ("n_embd", "n_kv"), c.attention_bias),
            "o_proj": proj(c.n_q, e, ("n_q", "n_embd")),
        }
        if c.qk_norm:
            layers |= {"q_norm": rms(c.dim_per_head), "k_norm": rms(c.dim_per_head)}
        layers["post_attention_layernorm"] = rms(e)
        layers["gate_proj"] = proj(e, mlp, ("n_embd", "n_mlp"))
        layers["up_proj"] = proj(e, mlp, ("n_embd", "n_mlp"))
        layers["down_proj"] = proj(mlp, e, ("n_mlp", "n_embd"))
        self.layers = Stack(layers)
        self.norm = Norm((e,), (None,), kind="rms", rngs=rngs)
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, table, ("vocab", "n_embd"), normal)


def num_params(c: LlamaConfig) -> int:
    """The exact number of parameters of ``Llama(c)``."""
    attention = c.hidden_size * (2 * c.n_q + 2 * c.n_kv)
    attention += (c.n_q + 2 * c.n_kv) if c.attention_bias else 0
    attention += 2 * c.dim_per_head if c.qk_norm else 0
    per_layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    tables = (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size
    return c.num_layers * per_layer + tables + c.hidden_size


def matmuls(c: LlamaConfig) -> Matmuls:
    """q, k, v, o projections (k and v n_kv wide), the three SwiGLU matrices, the head."""
    e, mlp = c.hidden_size, c.intermediate_size
    weights = ((e, c.n_q), (e, c.n_kv), (e, c.n_kv), (c.n_q, e), (e, mlp), (e, mlp), (mlp, e))
    return Matmuls(c.num_layers, weights, (e, c.vocab_size), c.n_q)


def decoder(c: LlamaConfig, compute_dtype: DTypeLike, lora_scale: float) -> CachedDecoder:
    sk = skeleton(c, compute_dtype, lora_scale=lora_scale)
    return CachedDecoder(sk, c.vocab_size, c.num_layers, c.dim_per_head, c.n_kv, (None, "n_kv"))


# --- Hugging Face: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM ----


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of a Llama, Mistral, Qwen2 or Qwen3 ``config.json``."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act={act!r}; theseus's SwiGLU MLP uses 'silu'")
    if hf.get("mlp_bias"):
        raise ValueError(
            f"{where}: mlp_bias=true is not supported (no Llama-family release uses it)"
        )
    heads = hf["num_attention_heads"]
    default_head_dim = 128 if model_type == "qwen3" else hf["hidden_size"] // heads
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or default_head_dim,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
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
    config = {
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model["head_dim"] or model["hidden_size"] // model["num_heads"],
        "max_position_embeddings": model["max_position_embeddings"],
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": model["tie_word_embeddings"],
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(model),
    }
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = model["attention_bias"]
    if model_type in ("qwen2", "qwen3"):
        config |= sliding.windows_to_hf(model)
    if model_type == "mistral":
        config["sliding_window"] = model.get("sliding_window")
    return config


def tensors(model: dict[str, Any]) -> list[HFTensor]:
    e, mlp, vocab = model["hidden_size"], model["intermediate_size"], model["vocab_size"]
    head_dim = model["head_dim"] or e // model["num_heads"]
    n_q, n_kv = model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim
    shapes = {
        "input_layernorm": (e,),
        "self_attn.q_proj": (n_q, e),
        "self_attn.k_proj": (n_kv, e),
        "self_attn.v_proj": (n_kv, e),
        "self_attn.o_proj": (e, n_q),
        "post_attention_layernorm": (e,),
        "mlp.gate_proj": (mlp, e),
        "mlp.up_proj": (mlp, e),
        "mlp.down_proj": (e, mlp),
    }
    if model["qk_norm"]:
        shapes |= {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}
    found = [whole("model.embed_tokens.weight", (vocab, e), "embed_tokens")]
    for layer in range(model["num_layers"]):
        prefix = f"model.layers.{layer}."
        for module, shape in shapes.items():
            path = f"layers/{module.split('.')[-1]}/weight"
            found.append(whole(f"{prefix}{module}.weight", shape, path, layer))
        if model["attention_bias"]:
            for x, width in (("q", n_q), ("k", n_kv), ("v", n_kv)):
                name = f"{prefix}self_attn.{x}_proj.bias"
                found.append(whole(name, (width,), f"layers/{x}_proj/bias", layer))
    found.append(whole("model.norm.weight", (e,), "norm/weight"))
    if not model["tie_word_embeddings"]:
        found.append(whole("lm_head.weight", (vocab, e), "lm_head"))
    return found


FAMILY = Family(
    name="llama",
    trainer_name="LlamaTrainer",
    config_class=LlamaConfig,
    model_class=Llama,
    plan=LLAMA_PLAN,
    context=lambda c: c.context,
    matmuls=matmuls,
    num_params=num_params,
    decoder=decoder,
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
        peft_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    descriptions={
        "train/pretrain": "train a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on byte "
        "or token data",
        "evaluate": "validation loss of the latest Llama-family checkpoint of a run",
    },
)
