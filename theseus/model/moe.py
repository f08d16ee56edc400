"""What the mixture-of-experts families built on the rotary grouped-query decoder share (Qwen3-MoE,
and the OLMoE and Mixtral to come): the expert hyperparameters, the settings that carry the
routing loss's constants, the sharding plan with the expert dimensions, the active-parameter
matmuls (for FLOPs), and the Hugging Face keys and tensors of the expert block. The block itself
is :mod:`theseus.model.experts`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

from theseus.accounting.activations import DecoderShape
from theseus.model import experts, gqa, gqa_hf
from theseus.model.decoder import Skeleton
from theseus.model.experts import N_EXPERT_MLP, Experts, RouterSums, Routing
from theseus.model.family import Family, HFTensor, Matmuls, Part, Stacks, whole
from theseus.model.gqa import GQA_PLAN, Settings, WindowedConfig, field
from theseus.sharding.axis import N_EXPERT, Axis, ShardingPlan

# The experts' MLP width is split over `shard` as a dense MLP's is (each device holds a slice of
# every expert) and over `batch` by ZeRO; the expert index stays whole unless the policy places
# it (ShardingPolicy.experts: over shard, batch or both, ahead of these rules).
MOE_PLAN = ShardingPlan(
    tp=[*GQA_PLAN.tp, (N_EXPERT, None), (N_EXPERT_MLP, Axis.SHARD)],
    zero=[*GQA_PLAN.zero, (N_EXPERT_MLP, Axis.BATCH)],
)


class MoEConfig(WindowedConfig):
    """A rotary grouped-query decoder whose MLPs are expert blocks (the names of Hugging Face's
    configs): ``num_experts`` experts per layer, ``num_experts_per_tok`` chosen per token, each
    ``moe_intermediate_size`` wide; training adds ``router_aux_loss_coef`` times the
    load-balancing loss."""

    num_experts: pydantic.StrictInt = field(8, "experts per layer", gt=0)
    num_experts_per_tok: pydantic.StrictInt = field(2, "experts each token is sent to", gt=0)
    moe_intermediate_size: pydantic.StrictInt = field(64, "each expert's MLP width", gt=0)
    router_aux_loss_coef: float = field(0.001, "load-balancing loss coefficient", ge=0)
    router_z_loss_coef: float = field(0.0, "router z-loss coefficient (0: off)", ge=0)
    expert_capacity: float | None = field(
        None, "each expert takes at most this × its even share of a batch's choices (None: "
        "dropless); experts / num_experts_per_tok drops nothing", gt=0,
    )  # fmt: skip

    @property
    def stacks(self) -> Stacks:
        """Which layers have experts (kind True) and so how they are stacked: every layer
        (a family whose layers mix dense and expert MLPs says otherwise)."""
        return Stacks((True,) * self.num_layers)

    @pydantic.model_validator(mode="after")
    def _top_k_fits(self) -> MoEConfig:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"{type(self).__name__}.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}; a token is sent to at most every expert."
            )
        return self


@dataclass(frozen=True)
class MoESettings(Settings):
    """A rotary layer's settings and the routing losses': the number of experts and the
    load-balancing and z-loss coefficients."""

    num_experts: int
    aux_coef: float
    z_coef: float = 0.0


def router_sums(s: MoESettings) -> RouterSums:
    """The empty routing statistics the expert layers add to."""
    return RouterSums.zeros(s.num_experts, s.aux_coef, s.z_coef)


def routed(sk: Skeleton, c: MoEConfig) -> Skeleton:
    """``sk`` (a rotary skeleton) whose layers add up routing statistics."""
    plain = {f.name: getattr(sk.settings, f.name) for f in dataclasses.fields(sk.settings)}
    settings = MoESettings(
        **plain,
        num_experts=c.num_experts,
        aux_coef=c.router_aux_loss_coef,
        z_coef=c.router_z_loss_coef,
    )
    return replace(sk, settings=settings, routing=router_sums)


def expert_block(c: MoEConfig, normalise: bool, rngs: nnx.Rngs) -> Experts:
    """Each layer's expert block (router weights renormalised when ``normalise``)."""
    dims = (c.num_layers, c.num_experts, c.hidden_size, c.moe_intermediate_size)
    return Experts.create(*dims, c.num_experts_per_tok, normalise, rngs, c.expert_capacity)


def expert_params(c: MoEConfig) -> int:
    """The parameters of the expert blocks of the layers that have them (``c.stacks``) and the
    gated MLPs of those that do not."""
    num_expert_layers, num_dense = len(c.stacks.layers(True)), len(c.stacks.layers(False))
    dims = (c.num_experts, c.hidden_size, c.moe_intermediate_size)
    return experts.num_params(num_expert_layers, *dims) + num_dense * 3 * c.hidden_size * (
        c.intermediate_size
    )


def matmuls(c: MoEConfig) -> Matmuls:
    """The matmuls a token runs through (active parameters): q, k, v, o, in an expert layer
    the router and its ``num_experts_per_tok`` experts' three matrices (in a dense layer its
    gated MLP's), the head."""
    e, active, mlp = (
        c.hidden_size,
        c.num_experts_per_tok * c.moe_intermediate_size,
        c.intermediate_size,
    )
    attention = ((e, c.n_q), (e, c.n_kv), (e, c.n_kv), (c.n_q, e))
    routed = ((e, c.num_experts), (e, active), (e, active), (active, e))
    dense = ((e, mlp), (e, mlp), (mlp, e))
    mlps = tuple(w for kind in c.stacks.kinds for w in (routed if kind else dense))
    return Matmuls(c.num_layers, attention, (e, c.vocab_size), c.n_q, mlps)


def decoder_shape(c: MoEConfig) -> DecoderShape:
    """The activations' dimensions: a gated MLP as wide as a token's chosen experts together,
    or as a dense layer's MLP where that is wider."""
    widths = [c.num_experts_per_tok * c.moe_intermediate_size]
    widths += [c.intermediate_size for _ in c.stacks.layers(False)]
    return replace(gqa.decoder_shape(c), mlp_width=max(widths))


def family(**kwargs: Any) -> Family:
    """A mixture-of-experts family (:func:`theseus.model.gqa.family`'s arguments): the plan
    with the expert dimensions, the active matmuls."""
    return replace(gqa.family(**kwargs), plan=MOE_PLAN, matmuls=matmuls, shape=decoder_shape)


def from_hf(hf: dict[str, Any], width_key: str = "moe_intermediate_size") -> dict[str, Any]:
    """The expert keys of a ``config.json`` (``num_experts``, or transformers 5's
    ``num_local_experts``; each expert's width under ``width_key``)."""
    return {
        "num_experts": hf.get("num_experts") or hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf[width_key],
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def to_hf(model: dict[str, Any], width_key: str = "moe_intermediate_size") -> dict[str, Any]:
    """The ``config.json`` keys of :func:`from_hf`."""
    return {
        "num_experts": model["num_experts"],
        "num_experts_per_tok": model["num_experts_per_tok"],
        width_key: model["moe_intermediate_size"],
        "router_aux_loss_coef": model["router_aux_loss_coef"],
    }


def layer_shapes(model: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A pre-norm expert layer's tensors besides its experts and q/k norms (Hugging Face's
    names under ``model.layers.N.``): its two norms and the self-attention projections."""
    e = model["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm": (e,), "post_attention_layernorm": (e,)}
    attention = gqa_hf.projection_shapes(model).items()
    return shapes | {k: v for k, v in attention if k.startswith("self_attn.")}


def every_layer(model: dict[str, Any]) -> Stacks:
    """The stacks of a model section whose every layer has experts: one."""
    return Stacks((True,) * model["num_layers"])


def expert_tensors(
    model: dict[str, Any],
    stacks: Stacks,
    block: str = "mlp",
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> list[HFTensor]:
    """Each expert layer's (``stacks``' layers of kind True) router ``{block}.gate.weight``
    (experts, n_embd) and, one tensor per expert (as transformers writes them),
    ``{block}.experts.N.<name>.weight`` of the gate, up and down matrices under their
    ``names`` (Mixtral's: w1, w3, w2)."""
    e, width = model["hidden_size"], model["moe_intermediate_size"]
    shapes = {"gate_proj": (width, e), "up_proj": (width, e), "down_proj": (e, width)}
    found = []
    for layer in stacks.layers(True):
        prefix, (stack, index) = f"model.layers.{layer}.{block}", stacks.place(layer)
        router = (model["num_experts"], e)
        found.append(whole(f"{prefix}.gate.weight", router, f"{stack}/mlp/gate/weight", index))
        for expert in range(model["num_experts"]):
            for name, (ours, shape) in zip(names, shapes.items(), strict=True):
                tensor = f"{prefix}.experts.{expert}.{name}.weight"
                path = f"{stack}/mlp/{ours}/weight"
                found.append(whole(tensor, shape, path, index, expert))
    return found


def fused_expert_tensors(model: dict[str, Any], stacks: Stacks) -> list[HFTensor]:
    """transformers 5's fused layout (its modules' own names, every family's): each expert
    layer's router ``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` (experts, 2 · width,
    n_embd: the gate's rows, then the up matrix's) and ``mlp.experts.down_proj`` (experts,
    n_embd, width)."""
    e, width, num_experts = (
        model["hidden_size"],
        model["moe_intermediate_size"],
        model["num_experts"],
    )
    found = []
    for layer in stacks.layers(True):
        prefix, (stack, index) = f"model.layers.{layer}.mlp", stacks.place(layer)
        router = (num_experts, e)
        found.append(whole(f"{prefix}.gate.weight", router, f"{stack}/mlp/gate/weight", index))
        gate, up = (Part(f"{stack}/mlp/{n}/weight", index, i * width, (i + 1) * width, axis=1)
                    for i, n in enumerate(("gate_proj", "up_proj")))  # fmt: skip
        fused = (num_experts, 2 * width, e)
        found.append(HFTensor(f"{prefix}.experts.gate_up_proj", fused, (gate, up)))
        down = (num_experts, e, width)
        found.append(
            whole(f"{prefix}.experts.down_proj", down, f"{stack}/mlp/down_proj/weight", index)
        )
    return found


def tensor_layouts(
    with_experts: Callable[[dict[str, Any], list[HFTensor]], list[HFTensor]],
    block: str = "mlp",
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    stacks: Callable[[dict[str, Any]], Stacks] = every_layer,
) -> dict[str, Any]:
    """An expert family's ``HFSpec`` tensor layouts from ``with_experts(model, expert
    tensors)`` (its whole checkpoint around the given expert tensors; ``stacks(model)``: which
    layers have experts, and where each layer is stacked): one tensor per expert
    (``tensors``, what transformers writes and export writes) and transformers 5's fused
    layout (read too); and the modules peft can adapt: the attention projections (peft cannot
    load per-expert gate and up adapters into transformers 5's fused expert parameters)."""
    return {
        "peft_targets": gqa.PEFT_TARGETS[:4],
        "tensors": lambda model: with_experts(
            model, expert_tensors(model, stacks(model), block, names)
        ),
        "other_layouts": (
            lambda model: with_experts(model, fused_expert_tensors(model, stacks(model))),
        ),
    }


def expert_sublayer(layer: Any, x: jax.Array, s: MoESettings) -> tuple[jax.Array, Routing]:
    """The stream ``x`` (batch, seq, n_embd) float32 plus the expert block ``layer.mlp`` of its
    ``post_attention_layernorm``, and the block's routing (the pre-norm families' second half)."""
    h = layer.post_attention_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
    out, routing = experts.mixture(layer.mlp, h, jax.nn.silu)
    return x + out.astype(jnp.float32), routing


def attention_params(c: MoEConfig, norms: int) -> int:
    """One layer's q, k, v, o weights, its two norms and ``norms`` parameters of q/k norms."""
    return c.hidden_size * (2 * c.n_q + 2 * c.n_kv) + 2 * c.hidden_size + norms
