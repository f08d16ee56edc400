"""LoRA adapters as ordinary annotated parameters: creation beside a model's projections, which
projections a pattern selects, and the merged weight ``W + (alpha / rank) · ΔW``.

LoRA adapts the weight of each :class:`~theseus.model.parts.Projection` a model holds: its
``lora`` becomes a :class:`~theseus.model.parts.Lora`, two parameters in the weight's own layout
(stored beside the weight as ``lora_a`` and ``lora_b``), each with one dimension replaced by the
rank:

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
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from theseus.model.parts import WEIGHT_NAME, Lora, Projection, projections, replace_projections

#: The logical name of an adapter's rank dimension; no rule shards it.
LORA_RANK = "lora_rank"
#: The parameter names of an adapter pair inside its module.
ADAPTERS = ("lora_a", "lora_b")


@dataclass(frozen=True)
class LoraSpec:
    """Which projections get adapters (``targets``: patterns; None: every
    :class:`~theseus.model.parts.Projection` of the model), of which ``rank``, scaled by
    ``alpha / rank``."""

    rank: int
    alpha: float
    targets: tuple[str, ...] | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class Adaptable:
    """One projection weight LoRA can adapt: the projection's ``key`` (its path as a tuple),
    the weight's ``path``, shape, logical names and layout."""

    key: tuple[str, ...]
    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    layout: str


def adaptable(model: nnx.Module) -> list[Adaptable]:
    """Every projection weight of ``model`` that LoRA can adapt, in the model's order."""
    found = []
    for key, proj in projections(model):
        shape = tuple(proj.weight.shape)
        names = tuple(proj.weight.get_metadata()["out_sharding"])
        path = "/".join([*key, WEIGHT_NAME[proj.layout]])
        found.append(Adaptable(key, path, shape, names, proj.layout))
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


def adapter_shapes(target: Adaptable, rank: int) -> tuple[tuple[tuple[int, ...], tuple], ...]:
    """``((shape, names) of lora_a, (shape, names) of lora_b)`` of a target's adapters."""
    shape, names = target.shape, target.names
    out_dim, in_dim = (-1, -2) if target.layout == "io" else (-2, -1)

    def replaced(dim: int) -> tuple[tuple[int, ...], tuple]:
        new_shape, new_names = list(shape), list(names)
        new_shape[dim], new_names[dim] = rank, LORA_RANK
        return tuple(new_shape), tuple(new_names)

    return replaced(out_dim), replaced(in_dim)


def add_adapters(model: nnx.Module, spec: LoraSpec, *, rngs: nnx.Rngs) -> None:
    """Give each projection of ``model`` that ``spec`` targets its ``lora_a`` (uniform in
    ``±1/sqrt(d_in)``, as peft initialises it) and ``lora_b`` (zeros) float32 parameters."""
    if spec.rank <= 0:
        raise ValueError(f"finetune.lora_rank={spec.rank} must be > 0 for LoRA adapters.")
    adapters = {}
    for target in targets(adaptable(model), spec.targets):
        d_in = target.shape[-2] if target.layout == "io" else target.shape[-1]
        bound = 1.0 / math.sqrt(d_in)

        def uniform(key, shape, dtype, b=bound):
            return jax.random.uniform(key, shape, dtype, -b, b)

        made = []
        for init, (shape, names) in zip(
            (uniform, nnx.initializers.zeros), adapter_shapes(target, spec.rank), strict=True
        ):
            init = nnx.with_partitioning(init, names, eager_sharding=False)
            made.append(nnx.Param(init(rngs.params(), shape, jnp.float32), eager_sharding=False))
        adapters[target.key] = Lora(a=made[0], b=made[1], scale=spec.scale)
    replace_projections(
        model, lambda key, proj: replace(proj, lora=adapters[key]) if key in adapters else proj
    )


def delta(lora: Lora, layout: str) -> jax.Array:
    """``ΔW`` of adapter arrays in the weight's layout, float32 at full precision (stacked dims
    batch)."""
    a, b = (lora.a, lora.b) if layout == "io" else (lora.b, lora.a)
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")


def merged_params(graphdef: nnx.GraphDef, params: Any) -> Any:
    """The parameter dict ``params`` of the model ``graphdef`` with every adapted weight
    replaced by ``W + scale · ΔW`` (float32) and the adapters removed: the model as the base
    architecture computes it (for export)."""
    model = nnx.merge(graphdef, params)

    def merge(key: tuple[str, ...], proj: Projection) -> Projection:
        if proj.lora is None:
            return proj
        lora = Lora(a=proj.lora.a.get_value(), b=proj.lora.b.get_value(), scale=proj.lora.scale)
        weight = proj.weight.get_value().astype(jnp.float32) + lora.scale * delta(lora, proj.layout)
        return replace(proj, weight=proj.weight.replace(weight), lora=None)

    replace_projections(model, merge)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def with_zero_adapters(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` whose adapters are zeros: what the base model computes, along the
    adapted model's own path (its other parameters are the same arrays)."""
    copy = nnx.merge(*nnx.split(model))

    def zeroed(key: tuple[str, ...], proj: Projection) -> Projection:
        if proj.lora is None:
            return proj
        a, b = proj.lora.a, proj.lora.b
        zeros = a.replace(jnp.zeros_like(a.get_value())), b.replace(jnp.zeros_like(b.get_value()))
        return replace(proj, lora=replace(proj.lora, a=zeros[0], b=zeros[1]))

    replace_projections(copy, zeroed)
    return copy
