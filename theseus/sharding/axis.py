"""Sharding vocabulary: mesh axes, the execution's policy, the model's plan and rule resolution.

A *rule* maps a logical name (a name for a tensor dimension, such as ``n_attn``) to a mesh axis,
a tuple of mesh axes, or ``None``. A model declares one :class:`ShardingPlan` (TP rules and
optionally ZeRO rules); the execution chooses one :class:`ShardingPolicy`. Together they give the
rules of each of the three parameter layouts (compute, storage, update).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import pydantic
from jax.sharding import PartitionSpec


class Axis:
    """The two mesh axes: ``batch`` (data replicas) and ``shard`` (TP devices of one replica)."""

    BATCH = "batch"
    SHARD = "shard"


MESH_AXES = (Axis.BATCH, Axis.SHARD)

MeshAxes = str | tuple[str, ...] | None
Rule = tuple[str, MeshAxes]
Phase = Literal["compute", "storage", "update"]
PHASES: tuple[Phase, ...] = ("compute", "storage", "update")
Remat = Literal["none", "full", "dots"]
#: What the backward pass recomputes per layer: nothing (every activation kept), the whole
#: layer, or everything but the outputs of matmuls without batch dimensions (the weight
#: projections; JAX's ``dots_with_no_batch_dims_saveable``).
REMAT_POLICIES: tuple[Remat, ...] = ("none", "full", "dots")
Placement = Literal["none", "shard", "batch", "both"]
#: The logical name of a mixture of experts' expert index, which the policy places on the mesh.
N_EXPERT = "n_expert"
#: Where ``ShardingPolicy.experts`` puts the expert index: nowhere (each expert's width is split
#: by the model's TP rules instead), over ``shard``, over ``batch`` (expert parallelism across
#: replicas) or over both.
EXPERT_AXES: dict[Placement, tuple[str, ...]] = {
    "none": (),
    "shard": (Axis.SHARD,),
    "batch": (Axis.BATCH,),
    "both": (Axis.SHARD, Axis.BATCH),
}
Exchange = Literal["partitioned", "all-reduce", "all-to-all"]


def token_exchange(placement: Placement) -> Exchange:
    """How an expert layer's tokens reach experts placed by ``placement``
    (:mod:`theseus.model.dispatch`). Over ``batch`` (alone or with ``shard``) the replicas owning
    a token's experts are not the one holding it: tokens go to their experts and outputs come
    back by ``all-to-all`` over ``batch``, the expert weights staying where they are. Over
    ``shard`` alone every device of a replica holds the replica's tokens: each runs its own
    experts on them and the outputs are summed over ``shard`` (``all-reduce``). Unplaced
    experts are split like a dense MLP and XLA partitions the layer (``partitioned``)."""
    axes = EXPERT_AXES[placement]
    return "all-to-all" if Axis.BATCH in axes else "all-reduce" if axes else "partitioned"


def remat_policy(value: object) -> Remat:
    """A recompute setting as one of :data:`REMAT_POLICIES`; ``True`` is ``"full"`` and
    ``False`` (or None) ``"none"``, as ``activation_checkpointing`` was a switch."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    if value not in REMAT_POLICIES:
        raise ValueError(
            f"activation checkpointing {value!r} is not a recompute policy; choose one of "
            f"{', '.join(REMAT_POLICIES)} (none keeps every activation, full recomputes each "
            "layer, dots keeps the weight matmuls' outputs and recomputes the rest)."
        )
    return value


class ShardingPolicy(pydantic.BaseModel):
    """The execution's choice of layouts.

    ``tp`` devices evaluate one replica together; ``zero`` partitions optimizer state and the
    update over ``batch``; ``fsdp`` additionally partitions stored parameters (and the gradient
    accumulator) over ``batch``; ``activation_checkpointing`` says what each layer recomputes
    in the backward pass (:data:`REMAT_POLICIES`; ``True``/``False`` are read as ``full``/``none``);
    ``experts`` where a mixture of experts' expert index goes (:data:`EXPERT_AXES`; a model
    without experts has none to place).
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True)

    tp: int = pydantic.Field(default=1, ge=1)
    zero: bool = True
    fsdp: bool = False
    activation_checkpointing: Remat = "none"
    experts: Placement = "none"

    @pydantic.field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _remat_policy(cls, value: object) -> Remat:
        return remat_policy(value)

    @pydantic.model_validator(mode="after")
    def _fsdp_requires_zero(self) -> ShardingPolicy:
        if self.fsdp and not self.zero:
            raise ValueError(
                "fsdp=True requires zero=True: FSDP requires ZeRO in theseus (stored parameter "
                "shards are the ZeRO partitions). Set zero=True or fsdp=False."
            )
        return self

    def merge(self, **changes: object) -> ShardingPolicy:
        """A new policy with ``changes`` applied over this one's fields (validated)."""
        return ShardingPolicy(**{**self.model_dump(), **changes})

    def describe(self) -> str:
        experts = "" if self.experts == "none" else f" experts={self.experts}"
        return (
            f"tp={self.tp} zero={self.zero} fsdp={self.fsdp} "
            f"activation_checkpointing={self.activation_checkpointing}{experts}"
        )

    @property
    def kind(self) -> Literal["DP", "ZeRO", "FSDP"]:
        """What is partitioned over ``batch``: nothing (DP), the update (ZeRO), storage (FSDP)."""
        return "FSDP" if self.fsdp else "ZeRO" if self.zero else "DP"

    @property
    def name(self) -> str:
        """``DP``, ``ZeRO`` or ``FSDP``, with `` tp=K`` when tensor parallel."""
        return self.kind if self.tp == 1 else f"{self.kind} tp={self.tp}"


def mesh_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of a rule or ``PartitionSpec`` entry: ``None`` → (), ``"batch"`` →
    ("batch",), a tuple as it is."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def uses_axis(spec: PartitionSpec, axis: str) -> bool:
    """Whether any dimension of ``spec`` is split over mesh axis ``axis``."""
    return any(axis in mesh_axes(entry) for entry in tuple(spec))


def _spec_entry(axes: Sequence[str]) -> MeshAxes:
    """One PartitionSpec entry: None, a single axis name, or a tuple of axis names."""
    if not axes:
        return None
    if len(axes) == 1:
        return axes[0]
    return tuple(axes)


def _validated_rules(rules: Iterable[Rule], which: str) -> tuple[Rule, ...]:
    checked: list[Rule] = []
    seen: set[str] = set()
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(
                f"{which} rule {rule!r} is not a (logical_name, mesh_axis | tuple_of_mesh_axes | "
                "None) pair."
            )
        name, axes = rule
        if name in seen:
            raise ValueError(
                f"{which} rules name {name!r} twice; give each logical name one rule (use a tuple "
                "of mesh axes to split a dimension over several axes)."
            )
        seen.add(name)
        axes_tuple = mesh_axes(axes)
        unknown = [axis for axis in axes_tuple if axis not in MESH_AXES]
        if unknown or len(set(axes_tuple)) != len(axes_tuple):
            raise ValueError(
                f"{which} rule for {name!r} maps to {axes!r}; mesh axes are {MESH_AXES}, each at "
                "most once."
            )
        checked.append((name, _spec_entry(axes_tuple)))
    return tuple(checked)


@dataclass(frozen=True, init=False)
class ShardingPlan:
    """A model's rules: TP rules for execution and ZeRO rules for partitions over ``batch``.

    When ``zero`` is None, every logical name that TP maps to an axis is mapped to ``batch`` for
    ZeRO. A model may instead give its own ZeRO rules (GPT partitions ``vocab`` over ``batch`` for
    ZeRO while leaving it whole for TP). One plan per model: submodules declare none.
    """

    tp: tuple[Rule, ...]
    zero: tuple[Rule, ...]

    def __init__(self, tp: Iterable[Rule], zero: Iterable[Rule] | None = None):
        tp_rules = _validated_rules(tp, "TP")
        zero_rules: tuple[Rule, ...]
        if zero is None:
            zero_rules = tuple((name, Axis.BATCH) for name, axes in tp_rules if axes is not None)
        else:
            zero_rules = _validated_rules(zero, "ZeRO")
        object.__setattr__(self, "tp", tp_rules)
        object.__setattr__(self, "zero", zero_rules)

    def merged(self) -> tuple[Rule, ...]:
        """TP+ZeRO rules: per logical name, the TP axes first, then the ZeRO axes not yet used."""
        tp = dict(self.tp)
        zero = dict(self.zero)
        rules = []
        for name in [*tp, *(n for n in zero if n not in tp)]:
            tp_axes = mesh_axes(tp.get(name))
            zero_axes = tuple(a for a in mesh_axes(zero.get(name)) if a not in tp_axes)
            rules.append((name, _spec_entry(tp_axes + zero_axes)))
        return tuple(rules)

    def rules(self, policy: ShardingPolicy, phase: Phase) -> tuple[Rule, ...]:
        """The rules of one layout: compute = TP; storage = TP+ZeRO when fsdp, else TP;
        update = TP+ZeRO when zero, else TP; in each, the expert index where the policy places
        it (:data:`EXPERT_AXES`), ahead of every other rule."""
        if phase == "compute":
            rules = self.tp
        elif phase == "storage":
            rules = self.merged() if policy.fsdp else self.tp
        elif phase == "update":
            rules = self.merged() if policy.zero else self.tp
        else:
            raise ValueError(f"unknown layout phase {phase!r}; expected one of {PHASES}")
        if policy.experts == "none":
            return rules
        placed = (N_EXPERT, _spec_entry(EXPERT_AXES[policy.experts]))
        return (placed, *(rule for rule in rules if rule[0] != N_EXPERT))


def partition_spec(names: Sequence[str | None] | None, rules: Iterable[Rule]) -> PartitionSpec:
    """Resolve a tensor's logical names to a PartitionSpec.

    Each dimension takes the axes of its rule that no earlier dimension of the same array has
    used. A name without a rule, a ``None`` name, and an array without names are unpartitioned.
    """
    if not names:
        return PartitionSpec()
    table = {name: mesh_axes(axes) for name, axes in rules}
    used: set[str] = set()
    entries = []
    for name in names:
        axes = tuple(a for a in table.get(name, ()) if a not in used) if name is not None else ()
        used.update(axes)
        entries.append(_spec_entry(axes))
    return PartitionSpec(*entries)
