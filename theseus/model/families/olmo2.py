"""The OLMo 2 family: AI2's OLMo 2 decoders (``model_type`` ``olmo2``).

Llama's pieces in another order: no norm before attention or the MLP; instead RMSNorm of each
sublayer's output before it is added to the residual stream (``post_attention_layernorm``,
``post_feedforward_layernorm``), and RMSNorm of the whole query and key projections (``q_norm``
n_q wide, ``k_norm`` n_kv wide, not per head) before the rotary embedding. Grouped-query
attention, a SwiGLU MLP, an untied head (a tied one is read too). Weights are stored as Hugging
Face stores them, ``(d_out, d_in)``, stacked along ``n_layer``, so checkpoints import and export
without permuting anything.
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
from theseus.model.decoder import CachedDecoder, DecoderModel, LayerInputs, Paths, Skeleton
from theseus.model.family import Context, Family, HFSpec, HFTensor, Matmuls, whole
from theseus.model.parts import Norm, Stack, StackedProjection, norm, param, project
from theseus.model.rotary import apply_rotary, inverse_frequencies, rope_from_hf, rope_to_hf, rotary
from theseus.sharding.axis import Axis, ShardingPlan

# TP splits the query heads (n_q = num_heads × head_dim), the key/value heads (n_kv), their norms'
# weights and the MLP over `shard` (the q/k norms' statistics then sum over `shard`); the residual
# width, vocabulary and layer count stay whole on each TP device. ZeRO also partitions the
# vocabulary (embedding and head) over `batch`.
OLMO2_PLAN = ShardingPlan(
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


class Olmo2Config(Section):
    """Hyperparameters of an OLMo 2 decoder (the names of Hugging Face's config).

    ``head_dim`` None means hidden_size / num_heads. rope_type ``llama3`` scales the rotary
    frequencies as Llama 3.1 does with the ``rope_*`` factors.
    """

    vocab_size: pydantic.StrictInt = _field(256, "token ids", gt=0)
    hidden_size: pydantic.StrictInt = _field(128, "residual width", gt=0)
    intermediate_size: pydantic.StrictInt = _field(352, "MLP width", gt=0)
    num_layers: pydantic.StrictInt = _field(4, "decoder layers", gt=0)
    num_heads: pydantic.StrictInt = _field(4, "query heads", gt=0)
    num_kv_heads: pydantic.StrictInt = _field(4, "key/value heads", gt=0)
    head_dim: pydantic.StrictInt | None = _field(
        None, "head width; None: hidden_size / num_heads", gt=0
    )
    max_position_embeddings: pydantic.StrictInt = _field(128, "context length", gt=0)
    rope_theta: float = _field(500000.0, "rotary base", gt=0)
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

    @pydantic.model_validator(mode="after")
    def _heads_fit(self) -> Olmo2Config:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Olmo2Config.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"Olmo2Config.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; set head_dim."
            )
        if self.dim_per_head % 2:
            raise ValueError(f"Olmo2Config: head_dim={self.dim_per_head} must be even (rotary).")
        return self

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def n_q(self) -> int:
        """Width of the query projection (all heads), and of its norm."""
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
    dtype = jnp.dtype(compute_dtype)
    inv_freq = tuple(float(f) for f in inverse_frequencies(c.dim_per_head, dict(c)))
    return Skeleton(
        embed=embed,
        features=features,
        layer=block,
        settings=Settings(c.dim_per_head, c.rms_norm_eps, inv_freq, dtype),
        paths=Paths(embed="embed_tokens", layers="layers", final_norm="norm", head="lm_head"),
        eps=c.rms_norm_eps,
        compute_dtype=dtype,
        context_len=c.max_position_embeddings,
        context_key="model.max_position_embeddings",
        remat=remat,
        lora_scale=lora_scale,
    )


class Olmo2(DecoderModel):
    """An OLMo 2 decoder (see the module docstring). State paths are Hugging Face's names, layers
    stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` unless tied; under ``layers/``:
    ``q_proj`` (n_layer, n_q, n_embd), ``k_proj``/``v_proj`` (n_layer, n_kv, n_embd),
    ``o_proj``, ``q_norm`` (n_layer, n_q), ``k_norm`` (n_layer, n_kv), the MLP's projections
    and the two output norms."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: Olmo2Config, rngs: nnx.Rngs) -> None:
        normal = nnx.initializers.normal(0.02)
        table = (c.vocab_size, c.hidden_size)
        self.embed_tokens = param(rngs, table, ("vocab", "n_embd"), normal)
        n, e, mlp = c.num_layers, c.hidden_size, c.intermediate_size

        def proj(d_in, d_out, names):
            return StackedProjection(n, d_in, d_out, names, "oi", bias=False, std=0.02, rngs=rngs)

        def rms(dim, name=None):
            return Norm((n, dim), ("n_layer", name), kind="rms", rngs=rngs)

        self.layers = Stack(
            {
                "q_proj": proj(e, c.n_q, ("n_embd", "n_q")),
                "k_proj": proj(e, c.n_kv, ("n_embd", "n_kv")),
                "v_proj": proj(e, c.n_kv, ("n_embd", "n_kv")),
                "o_proj": proj(c.n_q, e, ("n_q", "n_embd")),
                "q_norm": rms(c.n_q, "n_q"),
                "k_norm": rms(c.n_kv, "n_kv"),
                "post_attention_layernorm": rms(e),
                "gate_proj": proj(e, mlp, ("n_embd", "n_mlp")),
                "up_proj": proj(e, mlp, ("n_embd", "n_mlp")),
                "down_proj": proj(mlp, e, ("n_mlp", "n_embd")),
                "post_feedforward_layernorm": rms(e),
            }
        )
        self.norm = Norm((e,), (None,), kind="rms", rngs=rngs)
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, table, ("vocab", "n_embd"), normal)


def num_params(c: Olmo2Config) -> int:
    """The exact number of parameters of ``Olmo2(c)``."""
    e = c.hidden_size
    attention = e * (2 * c.n_q + 2 * c.n_kv) + c.n_q + c.n_kv  # projections, q/k norms
    per_layer = attention + 3 * e * c.intermediate_size + 2 * e
    tables = (1 if c.tie_word_embeddings else 2) * c.vocab_size * e
    return c.num_layers * per_layer + tables + e


def matmuls(c: Olmo2Config) -> Matmuls:
    """q, k, v, o projections (k and v n_kv wide), the three SwiGLU matrices, the head."""
    e, mlp = c.hidden_size, c.intermediate_size
    weights = ((e, c.n_q), (e, c.n_kv), (e, c.n_kv), (c.n_q, e), (e, mlp), (e, mlp), (mlp, e))
    return Matmuls(c.num_layers, weights, (e, c.vocab_size), c.n_q)


def decoder(c: Olmo2Config, compute_dtype: DTypeLike, lora_scale: float) -> CachedDecoder:
    sk = skeleton(c, compute_dtype, lora_scale=lora_scale)
    return CachedDecoder(sk, c.vocab_size, c.num_layers, c.dim_per_head, c.n_kv, (None, "n_kv"))


# --- Hugging Face: Olmo2ForCausalLM -------------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of an OLMo 2 ``config.json``."""
    del model_type  # olmo2 only
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act={act!r}; theseus's SwiGLU MLP uses 'silu'")
    if hf.get("attention_bias"):
        raise ValueError(
            f"{where}: attention_bias=true is not supported (no OLMo 2 release uses it); "
            "theseus's OLMo 2 attention has no biases"
        )
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **rope_from_hf(hf, where),
    }


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type  # olmo2 only
    return {
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
        "attention_bias": False,
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(model),
    }


def tensors(model: dict[str, Any]) -> list[HFTensor]:
    e, mlp, vocab = model["hidden_size"], model["intermediate_size"], model["vocab_size"]
    head_dim = model["head_dim"] or e // model["num_heads"]
    n_q, n_kv = model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim
    shapes = {
        "self_attn.q_proj": (n_q, e),
        "self_attn.k_proj": (n_kv, e),
        "self_attn.v_proj": (n_kv, e),
        "self_attn.o_proj": (e, n_q),
        "self_attn.q_norm": (n_q,),
        "self_attn.k_norm": (n_kv,),
        "post_attention_layernorm": (e,),
        "mlp.gate_proj": (mlp, e),
        "mlp.up_proj": (mlp, e),
        "mlp.down_proj": (e, mlp),
        "post_feedforward_layernorm": (e,),
    }
    found = [whole("model.embed_tokens.weight", (vocab, e), "embed_tokens")]
    for layer in range(model["num_layers"]):
        for module, shape in shapes.items():
            path = f"layers/{module.split('.')[-1]}/weight"
            found.append(whole(f"model.layers.{layer}.{module}.weight", shape, path, layer))
    found.append(whole("model.norm.weight", (e,), "norm/weight"))
    if not model["tie_word_embeddings"]:
        found.append(whole("lm_head.weight", (vocab, e), "lm_head"))
    return found


FAMILY = Family(
    name="olmo2",
    trainer_name="Olmo2Trainer",
    config_class=Olmo2Config,
    model_class=Olmo2,
    plan=OLMO2_PLAN,
    context=lambda c: Context(c.max_position_embeddings, "model.max_position_embeddings"),
    matmuls=matmuls,
    num_params=num_params,
    decoder=decoder,
    hf=HFSpec(
        architectures={"olmo2": "Olmo2ForCausalLM"},
        from_hf=from_hf,
        export_type=lambda model, imported: "olmo2",
        to_hf=to_hf,
        tensors=tensors,
        peft_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    descriptions={
        "train/pretrain": "train an OLMo 2 decoder on byte or token data",
        "evaluate": "validation loss of the latest OLMo 2 checkpoint of a run",
    },
)
