"""The plan of a constructed trainer, from its own abstract state and layouts: one row per
parameter, the share left whole across ``batch``, and the one-line plan a run prints first.

The planner (``theseus.plan``) builds on these for any device count; a training run uses them
directly, so it builds no extra trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec

from theseus.accounting.memory import format_bytes
from theseus.accounting.records import json_field
from theseus.accounting.text import (
    group_path,
    mesh_text,
    percent,
    shape_text,
    text_table,
)
from theseus.sharding.axis import PHASES, Axis, Phase, ShardingPolicy, partition_spec, uses_axis
from theseus.sharding.layout import LayoutError, indivisible_dims, shard_shape
from theseus.training.trainer import BaseTrainer

#: Above this share of parameters replicated across ``batch``, the largest such tensors are named.
REPLICATED_WARNING_SHARE = 0.02


@dataclass(frozen=True)
class PlanRow:
    """One parameter, or a group of parameters identical in shape, names and layouts."""

    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...] | None
    specs: dict[Phase, PartitionSpec]
    shards: dict[Phase, tuple[int, ...]] = json_field("shard_shapes")
    replicated_over_batch: bool = False  # the plan's TP+ZeRO rules leave it whole across `batch`
    problems: tuple[str, ...] = ()  # dims a layout cannot divide (shards shown rounded up)

    json_properties: ClassVar[dict[str, str]] = {"num_params": "params"}

    @property
    def path(self) -> str:
        return group_path(self.paths)

    @property
    def params_per_tensor(self) -> int:
        return math.prod(self.shape)

    @property
    def num_params(self) -> int:
        return self.params_per_tensor * len(self.paths)

    def spec(self, phase: Phase) -> PartitionSpec:
        return self.specs[phase]

    def shard(self, phase: Phase) -> tuple[int, ...]:
        return self.shards[phase]

    compute_spec = property(lambda self: self.specs["compute"])
    storage_spec = property(lambda self: self.specs["storage"])
    update_spec = property(lambda self: self.specs["update"])
    compute_shard = property(lambda self: self.shards["compute"])
    storage_shard = property(lambda self: self.shards["storage"])
    update_shard = property(lambda self: self.shards["update"])


class ReplicatedTensor(NamedTuple):
    path: str
    shape: tuple[int, ...]
    params: int


@dataclass(frozen=True)
class ReplicatedShare:
    """Parameters the plan's TP+ZeRO rules leave whole across ``batch`` (ZeRO and FSDP cannot
    partition them); ``largest`` names the biggest such tensors when the share exceeds 2%."""

    num_params: int = json_field("params")
    total_params: int = json_field("total_params")
    largest: tuple[ReplicatedTensor, ...] = ()

    json_properties: ClassVar[dict[str, str]] = {"fraction": "fraction"}

    @property
    def fraction(self) -> float:
        return self.num_params / self.total_params if self.total_params else 0.0


def plan_rows(
    trainer: BaseTrainer, policy: ShardingPolicy, mesh_shape: dict[str, int]
) -> tuple[PlanRow, ...]:
    """One row per parameter of ``trainer``'s abstract state under ``policy`` on a mesh of
    ``mesh_shape``, identical rows grouped."""
    merged = trainer.plan.merged()
    groups: dict[tuple, list[str]] = {}
    for leaf in trainer.abstract_leaves:
        specs = tuple(partition_spec(leaf.names, trainer.plan.rules(policy, p)) for p in PHASES)
        key = (leaf.shape, str(np.dtype(leaf.dtype)), leaf.names, specs)
        groups.setdefault(key, []).append(leaf.path)
    rows = []
    for (shape, dtype, names, specs), paths in groups.items():
        problems = [
            f"{phase}: {issue}"
            for phase, spec in zip(PHASES, specs, strict=True)
            for issue in indivisible_dims(shape, spec, mesh_shape)
        ]
        rows.append(
            PlanRow(
                paths=tuple(paths),
                shape=shape,
                dtype=dtype,
                names=names,
                specs=dict(zip(PHASES, specs, strict=True)),
                shards={
                    p: shard_shape(shape, s, mesh_shape) for p, s in zip(PHASES, specs, strict=True)
                },
                replicated_over_batch=not uses_axis(partition_spec(names, merged), Axis.BATCH),
                problems=tuple(problems),
            )
        )
    return tuple(rows)


def replicated_share(trainer: BaseTrainer) -> ReplicatedShare:
    """Parameters whose TP+ZeRO layout leaves them whole across ``batch``."""
    merged = trainer.plan.merged()
    replicated = [
        ReplicatedTensor(leaf.path, leaf.shape, math.prod(leaf.shape))
        for leaf in trainer.abstract_leaves
        if not uses_axis(partition_spec(leaf.names, merged), Axis.BATCH)
    ]
    count = sum(t.params for t in replicated)
    if count / max(trainer.num_params, 1) <= REPLICATED_WARNING_SHARE:
        return ReplicatedShare(count, trainer.num_params)
    largest = tuple(sorted(replicated, key=lambda t: (-t.params, t.path))[:5])
    return ReplicatedShare(count, trainer.num_params, largest)


def one_line_plan(trainer: BaseTrainer) -> str:
    """The plan of a constructed trainer in one line, for the start of a run: its policy and
    mesh, per-device model-state bytes, the same total for the other policies at its tp, and
    the share of parameters replicated across ``batch``."""
    totals = trainer.memory()
    others = []
    for kind in ("DP", "ZeRO", "FSDP"):
        other = trainer.policy.merge(zero=kind != "DP", fsdp=kind == "FSDP")
        if other == trainer.policy:
            continue
        try:
            others.append(f"{kind} {format_bytes(trainer.memory(other).total)}")
        except LayoutError:
            others.append(f"{kind} invalid")
    share = replicated_share(trainer)
    named = ""
    if share.largest:
        named = " (largest: " + ", ".join(t.path for t in share.largest[:3]) + ")"
    return (
        f"plan: {trainer.policy.name} on mesh {mesh_text(trainer.topology.mesh_shape)}; per "
        f"device {format_bytes(totals.params)} params + {format_bytes(totals.grad_accumulator)} "
        f"gradient sum + {format_bytes(totals.optimizer)} optimizer = "
        f"{format_bytes(totals.total)} ({', '.join(others)}); {percent(share.fraction)} of "
        f"parameters replicated across batch{named}"
    )


def layouts_text(trainer: BaseTrainer) -> str:
    """A run's ``layouts.txt``: its policy, mesh and batch, every parameter's layouts and its
    one-line plan, from the trainer itself."""
    topology = trainer.topology
    rows = plan_rows(trainer, trainer.policy, topology.mesh_shape)
    lines = [
        (
            f"{type(trainer).__name__}, {trainer.num_params:,} parameters on "
            f"{topology.num_devices} devices ({topology.num_processes} processes), mesh "
            f"{mesh_text(topology.mesh_shape)}"
        ),
        f"policy: {trainer.policy.name} ({trainer.policy.describe()})",
        trainer.batch_plan.describe(),
        "",
        *layout_table(rows),
        "",
        one_line_plan(trainer),
    ]
    return "\n".join(lines)


def layout_table(rows: Sequence[PlanRow]) -> list[str]:
    """The parameters section of a plan: path, shape, names, the three specs and shards."""
    tensors = sum(len(r.paths) for r in rows)
    lines = [f"parameters ({tensors} tensors in {len(rows)} rows; shards are per device)"]
    header = ["path", "shape", "names", *PHASES, "shard compute / storage / update"]
    table = [
        [
            ("! " if r.problems else "") + group_path(r.paths, width=48),
            shape_text(r.shape),
            "-" if r.names is None else "(" + ", ".join(str(n) for n in r.names) + ")",
            *(str(r.spec(phase)) for phase in PHASES),
            " / ".join(shape_text(r.shard(phase)) for phase in PHASES),
        ]
        for r in rows
    ]
    lines += text_table(header, table)
    if any(r.problems for r in rows):
        lines.append("  ! a layout of this policy cannot divide the tensor (shards rounded up)")
    return lines
