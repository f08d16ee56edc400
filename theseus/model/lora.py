"""LoRA adapters as ordinary annotated parameters: creation beside a model's projections, their
contribution to a projection's output, and the merged weight ``W + (alpha / rank) · ΔW``.

A module whose weight LoRA may adapt says so with two attributes: ``lora_weight`` (the name
of its weight parameter) and ``lora_layout`` (``"io"``: the weight is ``(.., d_in, d_out)``;
``"oi"``: ``(.., d_out, d_in)``, Hugging Face's layout). :func:`add_adapters` gives each targeted
module two parameters in the weight's own layout, each with one dimension replaced by the rank:

- ``lora_a``: the output dimension replaced, ``(.., d_in, rank)`` or ``(.., rank, d_in)``;
- ``lora_b``: the input dimension replaced, ``(.., rank, d_out)`` or ``(.., d_out, rank)``.

So ``ΔW = lora_a @ lora_b`` for ``io`` and ``lora_b @ lora_a`` for ``oi``, always in the
weight's layout; for ``oi`` the two are exactly peft's ``lora_A.weight (r, in)`` and
``lora_B.weight (out, r)``. They keep the weight's logical names (``n_layer`` first when
stacked, so they go through the layer scan with it) and add :data:`LORA_RANK`, which no plan
maps to a mesh axis: TP, ZeRO and FSDP shard them by the model's own rules. ``lora_b`` starts
at zero, so a model with fresh adapters computes what the base model computes.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from theseus.model.layers import dense

#: The logical name of an adapter's rank dimension; no rule shards it.
LORA_RANK = "lora_rank"
#: The parameter names of an adapter pair inside its module.
ADAPTERS = ("lora_a", "lora_b")


@dataclass(frozen=True)
class LoraSpec:
    """Which projections get adapters (``targets``: patterns; None: every projection the model
    declares adaptable), of which ``rank``, scaled by ``alpha / rank``."""

    rank: int
    alpha: float
    targets: tuple[str, ...] | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class Adaptable:
    """One projection weight LoRA can adapt: its module, path, shape, logical names, layout."""

    module: nnx.Module
    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    layout: str


def _names_of(param: nnx.Param, ndim: int) -> tuple[str | None, ...]:
    names = param.get_metadata().get("out_sharding") or (None,) * ndim
    return tuple(names)


def adaptable(model: nnx.Module) -> list[Adaptable]:
    """Every projection weight of ``model`` that LoRA can adapt, in the model's order."""
    found = []
    for path, module in nnx.iter_modules(model):
        name = getattr(module, "lora_weight", None)
        if name is None:
            continue
        param = getattr(module, name)
        shape = tuple(param.shape)
        full = "/".join([*(str(p) for p in path), name])
        # A module naming its lora_weight also gives its lora_layout (nnx: not declared).
        layout = module.lora_layout  # type: ignore[attr-defined]
        found.append(Adaptable(module, full, shape, _names_of(param, len(shape)), layout))
    return found


def matches(pattern: str, path: str, names: tuple[str | None, ...]) -> bool:
    """A pattern names a parameter by its path or one component of it (``fnmatch``:
    ``layers/*_proj/weight``, ``q_proj``, ``*_proj``) or by one of its logical names
    (``n_mlp``)."""
    parts = [path, *path.split("/")]
    return any(fnmatch.fnmatchcase(p, pattern) for p in parts) or pattern in names


def targets(candidates: list[Adaptable], patterns: tuple[str, ...] | None) -> list[Adaptable]:
    """The candidates that ``patterns`` select (all when None); a pattern that selects none is
    an error naming what it could have selected."""
    if patterns is None:
        return candidates
    for pattern in patterns:
        if not any(matches(pattern, c.path, c.names) for c in candidates):
            listed = ", ".join(f"{c.path} {c.names}" for c in candidates)
            raise ValueError(
                f"finetune.lora_targets pattern {pattern!r} matches no projection weight of the "
                f"model; LoRA can adapt: {listed or 'nothing (the model declares no projections)'}"
                ". A pattern matches a parameter path or one component of it (fnmatch, e.g. "
                "'layers/*_proj/weight', 'q_proj') or one of its logical names (e.g. 'n_mlp'); "
                "fix or remove it."
            )
    return [c for c in candidates if any(matches(p, c.path, c.names) for p in patterns)]


def adapter_shapes(target: Adaptable, rank: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """``{"lora_a": (shape, names), "lora_b": (shape, names)}`` of a target's adapters."""
    shape, names = target.shape, target.names
    out_dim, in_dim = (-1, -2) if target.layout == "io" else (-2, -1)

    def replaced(dim: int) -> tuple[tuple[int, ...], tuple]:
        new_shape, new_names = list(shape), list(names)
        new_shape[dim], new_names[dim] = rank, LORA_RANK
        return tuple(new_shape), tuple(new_names)

    return {"lora_a": replaced(out_dim), "lora_b": replaced(in_dim)}


def add_adapters(model: nnx.Module, spec: LoraSpec, *, rngs: nnx.Rngs) -> None:
    """Give each projection of ``model`` that ``spec`` targets its ``lora_a`` (uniform in
    ``±1/sqrt(d_in)``, as peft initialises it) and ``lora_b`` (zeros) float32 parameters."""
    if spec.rank <= 0:
        raise ValueError(f"finetune.lora_rank={spec.rank} must be > 0 for LoRA adapters.")
    for target in targets(adaptable(model), spec.targets):
        d_in = target.shape[-2] if target.layout == "io" else target.shape[-1]
        bound = 1.0 / math.sqrt(d_in)
        inits = {
            "lora_a": lambda key, shape, dtype, b=bound: jax.random.uniform(
                key, shape, dtype, -b, b
            ),
            "lora_b": nnx.initializers.zeros,
        }
        for name, (shape, names) in adapter_shapes(target, spec.rank).items():
            init = nnx.with_partitioning(inits[name], names, eager_sharding=False)
            value = init(rngs.params(), shape, jnp.float32)
            setattr(target.module, name, nnx.Param(value, eager_sharding=False))


def adapter_out(x: jax.Array, proj: dict, *, transposed: bool) -> jax.Array:
    """The adapters' share of a projection of ``x`` (.., d_in): ``x ΔWᵀ`` (``transposed``, the
    ``oi`` layout) or ``x ΔW`` (``io``), (.., d_out) float32, through the rank-wide product."""
    low = dense(x, proj["lora_a"], transposed=transposed)  # (.., rank)
    return dense(low, proj["lora_b"], jnp.float32, transposed=transposed)  # (.., d_out)


def scaled(layer: Any, scale: float) -> Any:
    """``layer`` (a dict of one layer's parameters) with each ``lora_b`` multiplied by
    ``scale`` (alpha / rank): the model applies it once per layer, inside the layer scan, so
    the projection code needs no scale."""
    if not isinstance(layer, dict):
        return layer
    return {k: (v * scale if k == "lora_b" else scaled(v, scale)) for k, v in layer.items()}


def delta(lora_a: jax.Array, lora_b: jax.Array, layout: str) -> jax.Array:
    """``ΔW`` in the weight's layout, float32 at full precision (stacked dims batch)."""
    a, b = (lora_a, lora_b) if layout == "io" else (lora_b, lora_a)
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")


def has_adapters(params: Any) -> bool:
    """Whether a parameter dict holds any adapter."""
    if not isinstance(params, dict):
        return False
    return any(k in ADAPTERS or has_adapters(v) for k, v in params.items())


def merged(params: Any, scale: float, layout_of: Callable[[str], str], prefix: str = "") -> Any:
    """``params`` (a nested dict) with every adapted weight replaced by ``W + scale · ΔW``
    (float32) and the adapters removed: the model as the base architecture computes it.
    ``layout_of(path)`` is the layout (``io``/``oi``) of the adapters at ``path/lora_a``; the
    adapted weight is their sibling that is neither an adapter nor a ``bias``."""
    if not isinstance(params, dict):
        return params
    if "lora_a" not in params:
        return {k: merged(v, scale, layout_of, f"{prefix}{k}/") for k, v in params.items()}
    rest = {k: v for k, v in params.items() if k not in ADAPTERS}
    (weight,) = [k for k in rest if k != "bias"]
    layout = layout_of(f"{prefix}lora_a")
    update = scale * delta(params["lora_a"], params["lora_b"], layout)
    rest[weight] = rest[weight].astype(jnp.float32) + update
    return rest


def adapter_layout(lora_a_names: tuple[str | None, ...]) -> str:
    """The layout of adapters whose ``lora_a`` has these logical names: ``io`` when the rank
    is its last dimension (``(.., d_in, rank)``), else ``oi``."""
    return "io" if lora_a_names[-1] == LORA_RANK else "oi"
