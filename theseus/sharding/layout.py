"""Layouts: pytrees of ``NamedSharding`` resolved from logical names, and the pre-flight check.

An *abstract state* is any pytree whose leaves have a shape (``jax.ShapeDtypeStruct``, arrays),
where annotated leaves are ``nnx.Variable`` objects carrying logical names in their
``out_sharding`` metadata (as ``nnx.with_partitioning`` sets them), e.g. ``nnx.state`` of a model
built under ``nnx.eval_shape``. Unannotated leaves are replicated under every layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from theseus.sharding.axis import (
    N_EXPERT,
    PHASES,
    Phase,
    Rule,
    ShardingPlan,
    ShardingPolicy,
    mesh_axes,
    partition_spec,
)

_NAMES_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


@dataclass(frozen=True)
class AbstractLeaf:
    """One leaf of an abstract state: where it is, its global shape and its logical names."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    names: tuple[str | None, ...] | None


@dataclass(frozen=True)
class Layouts:
    """The three parameter layouts: pytrees of ``NamedSharding`` shaped like the abstract state."""

    compute: Any
    storage: Any
    update: Any

    def __getitem__(self, phase: Phase) -> Any:
        if phase not in PHASES:
            raise ValueError(f"unknown layout phase {phase!r}; expected one of {PHASES}")
        return getattr(self, phase)


def is_sharding(x: object) -> bool:
    """A pytree leaf test: layouts hold ``NamedSharding`` leaves (which are not pytrees)."""
    return isinstance(x, NamedSharding)


def _is_variable(x: object) -> TypeGuard[nnx.Variable]:
    return isinstance(x, nnx.Variable)


def path_str(path: Sequence[Any]) -> str:
    """A readable state path such as ``blocks/attn_qkv`` from a pytree key path."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def leaf_at(tree: dict, path: str) -> Any:
    """The leaf of nested dicts ``tree`` at a :func:`path_str` path (``blocks/attn_qkv``)."""
    node: Any = tree
    for key in path.split("/"):
        node = node[key]
    return node


def _leaf_names(leaf: object) -> tuple[str | None, ...] | None:
    if not _is_variable(leaf):
        return None
    metadata = leaf.get_metadata()
    for key in _NAMES_METADATA_KEYS:
        names = metadata.get(key)
        if names:
            return tuple(names)
    return None


def abstract_leaves(abstract_state: Any) -> tuple[list[AbstractLeaf], Any]:
    """Flatten an abstract state into leaves (``nnx.Variable`` counts as one leaf) and a treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=_is_variable)
    leaves = []
    for path, leaf in flat:
        value = leaf.get_value() if _is_variable(leaf) else leaf
        shape = tuple(np.shape(value))
        dtype = getattr(value, "dtype", None) or np.asarray(value).dtype
        leaves.append(AbstractLeaf(path_str(path), shape, np.dtype(dtype), _leaf_names(leaf)))
    return leaves, treedef


def leaf_spec(leaf: AbstractLeaf, rules: Sequence[Rule]) -> PartitionSpec:
    return partition_spec(leaf.names, rules)


def layout(abstract_state: Any, rules: Sequence[Rule], mesh: Mesh | AbstractMesh) -> Any:
    """One layout: a ``NamedSharding`` per leaf, shaped like ``abstract_state``."""
    leaves, treedef = abstract_leaves(abstract_state)
    shardings = [NamedSharding(mesh, leaf_spec(leaf, rules)) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, shardings)


def abstract_with(tree: Any, shardings: Any) -> Any:
    """``tree``'s shapes and dtypes as ``jax.ShapeDtypeStruct`` leaves placed by ``shardings`` (a
    layout of the same structure): the target of a restore, or an argument of an ahead-of-time
    compile, that allocates nothing."""
    return jax.tree.map(
        lambda value, sharding: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding),
        tree,
        shardings,
    )


def resolve_layouts(
    abstract_state: Any, plan: ShardingPlan, policy: ShardingPolicy, mesh: Mesh | AbstractMesh
) -> Layouts:
    """The compute, storage and update layouts of a parameter state."""
    return Layouts(**{p: layout(abstract_state, plan.rules(policy, p), mesh) for p in PHASES})


def optimizer_layout(
    optimizer: optax.GradientTransformation,
    abstract_opt_state: Any,
    param_update_layout: Any,
    mesh: Mesh | AbstractMesh,
) -> Any:
    """The optimizer state's layout: parameter-shaped state (Adam's moments) follows the update
    layout of its parameter; everything else (step counters, scalars) is replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt_state,
        param_update_layout,
        transform_non_params=lambda _: replicated,
        is_leaf=is_sharding,
    )


@dataclass(frozen=True)
class LayoutProblem:
    """A leaf that a layout cannot hold without padding."""

    leaf: AbstractLeaf
    phase: Phase
    spec: PartitionSpec
    reason: str


class LayoutError(ValueError):
    """Raised before anything is allocated when a layout does not divide a tensor evenly."""

    def __init__(self, problems: Sequence[LayoutProblem], mesh_shape: dict[str, int]):
        self.problems = tuple(problems)
        mesh = ", ".join(f"{axis}={size}" for axis, size in mesh_shape.items())
        lines = [
            f"Layout check failed for {len({p.leaf.path for p in problems})} tensor(s) on mesh "
            f"({mesh}); theseus never pads or silently replicates:"
        ]
        # One line per leaf and failure; layouts failing the same way are named together.
        phases_by_failure: dict[tuple, list[str]] = {}
        for p in problems:
            phases_by_failure.setdefault((p.leaf.path, p.leaf, p.spec, p.reason), []).append(
                p.phase
            )
        for (path, leaf, spec, reason), phases in phases_by_failure.items():
            lines.append(
                f"  {path}: shape {leaf.shape}, names {leaf.names}, {' and '.join(phases)} spec "
                f"{spec}: {reason}"
            )
        lines.append(
            "Fix: make each listed dimension a multiple of its split (e.g. pad the vocabulary or "
            "change the model size), choose a tp that divides it, or drop the partition over "
            "batch (fsdp=False for storage, zero=False for the update)."
        )
        if any(f"({N_EXPERT})" in p.reason for p in problems):
            lines.append(
                f"The expert count ({N_EXPERT}) must divide by the mesh axes the policy places "
                "experts over: choose --experts none|shard|batch|both to fit it, or a tp (the "
                "shard axis) and device count whose batch axis divides it."
            )
        super().__init__("\n".join(lines))


def _pieces(entry: Any, mesh_shape: dict[str, int]) -> int:
    return math.prod(mesh_shape[axis] for axis in mesh_axes(entry))


def indivisible_dims(
    shape: Sequence[int],
    spec: PartitionSpec,
    mesh_shape: dict[str, int],
    names: Sequence[str | None] | None = None,
) -> list[str]:
    """Why ``spec`` cannot place an array of ``shape`` without padding: one reason per dimension
    that its split does not divide (empty when the layout is valid), naming the dimension's
    logical name when ``names`` are given."""
    reasons = []
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec), strict=False)):
        pieces = _pieces(entry, mesh_shape)
        if size % pieces:
            split = " × ".join(f"{axis}={mesh_shape[axis]}" for axis in mesh_axes(entry))
            name = f" ({names[dim]})" if names and names[dim] else ""
            reasons.append(
                f"dim {dim}{name} of size {size} does not divide into {pieces} pieces ({split})"
            )
    return reasons


def shard_shape(
    shape: Sequence[int], spec: PartitionSpec, mesh_shape: dict[str, int]
) -> tuple[int, ...]:
    """The per-device shape of an array of ``shape`` under ``spec``, rounded up where a
    dimension does not divide (:func:`indivisible_dims` names those)."""
    shard = list(shape)
    for dim, entry in enumerate(tuple(spec)):
        shard[dim] = -(-shard[dim] // _pieces(entry, mesh_shape))
    return tuple(shard)


def _leaf_problems(leaf: AbstractLeaf, spec: PartitionSpec, mesh_shape) -> list[str]:
    if leaf.names is not None and len(leaf.names) != len(leaf.shape):
        return [f"{len(leaf.names)} logical names for a tensor of rank {len(leaf.shape)}"]
    return indivisible_dims(leaf.shape, spec, mesh_shape, leaf.names)


def check_layouts(
    abstract_state: Any,
    plan: ShardingPlan,
    policy: ShardingPolicy,
    mesh: Mesh | AbstractMesh,
    phases: Sequence[Phase] = PHASES,
) -> None:
    """Check every leaf of every given layout divides evenly; raise one error listing them all."""
    leaves, _ = abstract_leaves(abstract_state)
    mesh_shape = dict(mesh.shape)
    problems = []
    for leaf in leaves:
        for phase in phases:
            spec = leaf_spec(leaf, plan.rules(policy, phase))
            problems += [
                LayoutProblem(leaf, phase, spec, reason)
                for reason in _leaf_problems(leaf, spec, mesh_shape)
            ]
    if problems:
        raise LayoutError(problems, mesh_shape)
