"""What the rotary grouped-query decoders (Llama, OLMo 2, Gemma) share: their sharding plan, the
config fields that have the same meaning in each, the plain embedding and rotary features, the
matmul shapes, the cached decoder, and the Hugging Face keys and tensor names they have in common.
A family module adds only what makes it itself (its layer, its extra settings and tensors).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

from theseus.config import Section
from theseus.model import windows as sliding
from theseus.model.decoder import CachedDecoder, DecoderModel, LayerInputs, Paths, Skeleton
from theseus.model.family import Context, Family, HFSpec, HFTensor, Matmuls, whole
from theseus.model.parts import StackedProjection, param, project
from theseus.model.rotary import apply_rotary, inverse_frequencies, rotary
from theseus.sharding.axis import Axis, ShardingPlan

# TP splits the query heads (n_q = num_heads × head_dim), the key/value heads (n_kv) and the MLP
# over `shard`; the residual width, vocabulary and layer count stay whole on each TP device.
# Heads are contiguous slices of n_q and n_kv, so each device holds whole heads when tp divides
# num_kv_heads (results are correct for any tp that divides the widths). ZeRO also partitions
# the vocabulary (embedding and head) over `batch`.
GQA_PLAN = ShardingPlan(
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

#: The Hugging Face modules peft adapts in these decoders (their projections' names).
PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def field(default: Any, description: str, **limits: Any) -> Any:
    return pydantic.Field(default, description=description, **limits)


class GQAConfig(Section):
    """The hyperparameters every rotary grouped-query decoder has (the names of Hugging Face's
    configs). ``head_dim`` None means hidden_size / num_heads. rope_type ``linear`` divides the
    rotary frequencies by ``rope_factor``; ``llama3`` scales them as Llama 3.1 does with the
    ``rope_*`` factors."""

    vocab_size: pydantic.StrictInt = field(256, "token ids", gt=0)
    hidden_size: pydantic.StrictInt = field(128, "residual width", gt=0)
    intermediate_size: pydantic.StrictInt = field(352, "MLP width", gt=0)
    num_layers: pydantic.StrictInt = field(4, "decoder layers", gt=0)
    num_heads: pydantic.StrictInt = field(4, "query heads", gt=0)
    num_kv_heads: pydantic.StrictInt = field(2, "key/value heads", gt=0)
    head_dim: pydantic.StrictInt | None = field(
        None, "head width; None: hidden_size / num_heads", gt=0
    )
    max_position_embeddings: pydantic.StrictInt = field(128, "context length", gt=0)
    rope_theta: float = field(10000.0, "rotary base", gt=0)
    rope_type: Literal["default", "linear", "llama3"] = field(
        "default", "rotary frequencies: plain, divided by rope_factor, or Llama 3.1's scaling"
    )
    rope_factor: float = field(8.0, "linear and llama3: scaling factor", gt=0)
    rope_low_freq_factor: float = field(1.0, "llama3: low factor", gt=0)
    rope_high_freq_factor: float = field(4.0, "llama3: high factor", gt=0)
    rope_original_max_position_embeddings: pydantic.StrictInt = field(
        8192, "llama3: original context length", gt=0
    )
    rms_norm_eps: float = field(1e-6, "RMSNorm epsilon", gt=0)
    tie_word_embeddings: bool = field(False, "output head = embedding")

    @pydantic.model_validator(mode="after")
    def _heads_fit(self) -> GQAConfig:
        owner = type(self).__name__
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{owner}.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"{owner}.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; set head_dim."
            )
        if self.dim_per_head % 2:
            raise ValueError(f"{owner}: head_dim={self.dim_per_head} must be even (rotary).")
        return self

    @property
    def context(self) -> Context:
        return Context(self.max_position_embeddings, "model.max_position_embeddings")

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

    @property
    def table_params(self) -> int:
        """Parameters of the token table, the untied head and the final norm."""
        tables = (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size
        return tables + self.hidden_size

    @property
    def projection_params(self) -> int:
        """Parameters of one layer's q, k, v, o and MLP weights (no biases)."""
        e = self.hidden_size
        return e * (2 * self.n_q + 2 * self.n_kv) + 3 * e * self.intermediate_size


class WindowedConfig(GQAConfig):
    """A :class:`GQAConfig` whose layers may slide: ``sliding_window`` is the attention window
    of the layers that do (a query reads the ``sliding_window`` latest positions up to its own);
    ``layer_types`` says which (Hugging Face's names; None: every layer when there is a window).
    Sequences may be longer than the window, in training and in decoding."""

    sliding_window: pydantic.StrictInt | None = field(
        None, "attention window of the sliding layers; None: whole context", gt=0
    )
    layer_types: tuple[sliding.LayerType, ...] | None = field(
        None, "each layer's attention; None: every layer slides when sliding_window is set"
    )

    @pydantic.model_validator(mode="after")
    def _windows_fit(self) -> WindowedConfig:
        window, layers = self.sliding_window, self.num_layers
        sliding.check_layer_types(type(self).__name__, self.layer_types, layers, window)
        return self

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: the whole context)."""
        return sliding.layer_windows(self.layer_types, self.num_layers, self.sliding_window)


@dataclass(frozen=True)
class Settings:
    """What a plain rotary layer reads besides its weights (Llama, OLMo 2)."""

    head_dim: int
    eps: float
    inv_freq: tuple[float, ...]
    compute_dtype: jnp.dtype


def embed(params: dict, tokens: jax.Array, positions: jax.Array, s: Any) -> jax.Array:
    del positions, s  # positions enter through the rotary features
    return params["embed_tokens"][tokens].astype(jnp.float32)  # (batch, seq, n_embd)


def features(positions: jax.Array, s: Settings) -> tuple[jax.Array, jax.Array]:
    return rotary(positions, s.inv_freq)  # cos, sin (batch or 1, seq, head_dim)


def rotary_skeleton(
    c: GQAConfig, layer: Callable, compute_dtype: Any, remat: bool | str, lora_scale: float
) -> Skeleton:
    """The skeleton of a decoder of ``layer``s that reads :class:`Settings`: the plain token
    table, rotary features of ``c``'s frequencies, Hugging Face's parameter names."""
    dtype = jnp.dtype(compute_dtype)
    inv_freq = tuple(float(f) for f in inverse_frequencies(c.dim_per_head, dict(c)))
    return Skeleton(
        embed=embed,
        features=features,
        layer=layer,
        settings=Settings(c.dim_per_head, c.rms_norm_eps, inv_freq, dtype),
        paths=Paths(embed="embed_tokens", layers="layers", final_norm="norm", head="lm_head"),
        eps=c.rms_norm_eps,
        compute_dtype=dtype,
        context_len=c.max_position_embeddings,
        context_key="model.max_position_embeddings",
        remat=remat,
        lora_scale=lora_scale,
    )


def attention_projections(
    c: GQAConfig, rngs: nnx.Rngs, *, bias: bool = False
) -> dict[str, StackedProjection]:
    """Each layer's q, k, v (with biases when ``bias``) and o projections, Hugging Face's
    ``(d_out, d_in)`` layout, stacked along ``n_layer``."""
    n, e = c.num_layers, c.hidden_size

    def proj(d_in, d_out, names, with_bias):
        return StackedProjection(n, d_in, d_out, names, "oi", bias=with_bias, std=0.02, rngs=rngs)

    return {
        "q_proj": proj(e, c.n_q, ("n_embd", "n_q"), bias),
        "k_proj": proj(e, c.n_kv, ("n_embd", "n_kv"), bias),
        "v_proj": proj(e, c.n_kv, ("n_embd", "n_kv"), bias),
        "o_proj": proj(c.n_q, e, ("n_q", "n_embd"), False),
    }


def mlp_projections(c: GQAConfig, rngs: nnx.Rngs) -> dict[str, StackedProjection]:
    """Each layer's gated MLP: gate and up (n_embd to n_mlp), down."""
    n, e, mlp = c.num_layers, c.hidden_size, c.intermediate_size

    def proj(d_in, d_out, names):
        return StackedProjection(n, d_in, d_out, names, "oi", bias=False, std=0.02, rngs=rngs)

    return {
        "gate_proj": proj(e, mlp, ("n_embd", "n_mlp")),
        "up_proj": proj(e, mlp, ("n_embd", "n_mlp")),
        "down_proj": proj(mlp, e, ("n_mlp", "n_embd")),
    }


def token_table(c: GQAConfig, rngs: nnx.Rngs) -> nnx.Param:
    """The token table (vocab, n_embd), normal(0.02) initialised (a family creates it first)."""
    shape = (c.vocab_size, c.hidden_size)
    return param(rngs, shape, ("vocab", "n_embd"), nnx.initializers.normal(0.02))


def add_head(model: nnx.Module, c: GQAConfig, final_norm: nnx.Module, rngs: nnx.Rngs) -> None:
    """The final ``norm`` and, unless the head is tied, ``lm_head`` (created last)."""
    # nnx modules take their sub-modules as attributes set at build time (not declared).
    model.norm = final_norm  # type: ignore[attr-defined]
    if not c.tie_word_embeddings:
        model.lm_head = token_table(c, rngs)  # type: ignore[attr-defined]


def self_attention(
    layer: dict,
    h: jax.Array,
    inputs: LayerInputs,
    rotation: tuple[jax.Array, jax.Array],
    head_dim: int,
    head_norm: Callable[[jax.Array, dict], jax.Array],
) -> jax.Array:
    """Grouped-query self-attention of the normed stream ``h`` (batch, seq, n_embd): q, k, v
    heads, ``head_norm(heads, params)`` of q and k per head when the layer has ``q_norm`` and
    ``k_norm``, the rotary ``rotation`` (cos, sin), ``inputs.attend``, then ``o_proj``.
    Returns (batch, seq, n_embd) in ``h``'s dtype."""
    batch, seq, _ = h.shape
    cos, sin = rotation
    q, k, v = (
        project(h, layer[name]).reshape(batch, seq, -1, head_dim)
        for name in ("q_proj", "k_proj", "v_proj")
    )  # q (batch, seq, heads, head_dim); k, v (batch, seq, kv_heads, head_dim)
    if "q_norm" in layer:
        q, k = head_norm(q, layer["q_norm"]), head_norm(k, layer["k_norm"])
    attended = inputs.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
    return project(attended.reshape(batch, seq, -1), layer["o_proj"])  # (batch, seq, n_embd)


def matmuls(c: GQAConfig) -> Matmuls:
    """q, k, v, o projections (k and v n_kv wide), the three gated-MLP matrices, the head."""
    e, mlp = c.hidden_size, c.intermediate_size
    weights = ((e, c.n_q), (e, c.n_kv), (e, c.n_kv), (c.n_q, e), (e, mlp), (e, mlp), (mlp, e))
    return Matmuls(c.num_layers, weights, (e, c.vocab_size), c.n_q)


def family(
    name: str,
    config_class: type[GQAConfig],
    model_class: type[DecoderModel],
    num_params: Callable[[Any], int],
    hf: HFSpec,
    descriptions: dict[str, str],
) -> Family:
    """A rotary grouped-query family: :data:`GQA_PLAN`, these matmuls, the cached decoder of
    the model's skeleton, trainer ``<Model>Trainer``."""
    return Family(
        name=name,
        trainer_name=f"{model_class.__name__}Trainer",
        config_class=config_class,
        model_class=model_class,
        plan=GQA_PLAN,
        context=lambda c: c.context,
        matmuls=matmuls,
        num_params=num_params,
        decoder=partial(cached_decoder, model_class.skeleton_of),
        hf=hf,
        descriptions=descriptions,
    )


def cached_decoder(
    skeleton_of: Callable[..., Skeleton], c: GQAConfig, compute_dtype: Any, lora_scale: float
) -> CachedDecoder:
    """The KV-cache decoder of ``skeleton_of(c, ...)``: caches n_kv wide, split as k/v are."""
    sk = skeleton_of(c, compute_dtype, lora_scale=lora_scale)
    return CachedDecoder(sk, c.vocab_size, c.num_layers, c.dim_per_head, c.n_kv, (None, "n_kv"))


# --- Hugging Face ---------------------------------------------------------------------------


def check_key(hf: dict[str, Any], key: str, supported: Any, default: Any, where: str) -> None:
    """Refuse a ``config.json`` whose ``key`` (absent or null: ``default``) is not
    ``supported``."""
    value = default if hf.get(key) is None else hf[key]
    if value != supported:
        raise ValueError(
            f"{where}: {key}={json.dumps(value)} is not supported; theseus reproduces "
            f"{key}={json.dumps(supported)} for this model type"
        )


def from_hf_common(hf: dict[str, Any], default_head_dim: int | None, default_eps: float) -> dict:
    """The model-section keys every rotary grouped-query ``config.json`` has (``head_dim``
    absent: ``default_head_dim``, else hidden_size / num_heads)."""
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or default_head_dim or hf["hidden_size"] // heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "rms_norm_eps": float(hf.get("rms_norm_eps", default_eps)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def to_hf_common(model: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` keys of :func:`from_hf_common`."""
    return {
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": widths(model)[0],
        "max_position_embeddings": model["max_position_embeddings"],
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": model["tie_word_embeddings"],
    }


def widths(model: dict[str, Any]) -> tuple[int, int, int]:
    """head_dim, n_q and n_kv of a model section."""
    head_dim = model["head_dim"] or model["hidden_size"] // model["num_heads"]
    return head_dim, model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim


def projection_shapes(model: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Hugging Face's (d_out, d_in) of each layer's attention and MLP projections."""
    e, mlp = model["hidden_size"], model["intermediate_size"]
    _, n_q, n_kv = widths(model)
    return {
        "self_attn.q_proj": (n_q, e),
        "self_attn.k_proj": (n_kv, e),
        "self_attn.v_proj": (n_kv, e),
        "self_attn.o_proj": (e, n_q),
        "mlp.gate_proj": (mlp, e),
        "mlp.up_proj": (mlp, e),
        "mlp.down_proj": (e, mlp),
    }


def checkpoint_tensors(
    model: dict[str, Any], layer_weights: dict[str, tuple[int, ...]], extra: Iterable[HFTensor] = ()
) -> list[HFTensor]:
    """The checkpoint's tensors: the token table, each layer's ``layer_weights`` (module name
    under ``model.layers.N.`` to shape; theseus path ``layers/<last name>/weight``), ``extra``
    tensors, the final norm and the untied head."""
    e, vocab = model["hidden_size"], model["vocab_size"]
    found = [whole("model.embed_tokens.weight", (vocab, e), "embed_tokens")]
    for layer in range(model["num_layers"]):
        for module, shape in layer_weights.items():
            path = f"layers/{module.split('.')[-1]}/weight"
            found.append(whole(f"model.layers.{layer}.{module}.weight", shape, path, layer))
    found.extend(extra)
    found.append(whole("model.norm.weight", (e,), "norm/weight"))
    if not model["tie_word_embeddings"]:
        found.append(whole("lm_head.weight", (vocab, e), "lm_head"))
    return found
