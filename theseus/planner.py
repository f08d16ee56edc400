"""Plan before you train: every layout and the per-device memory for any mesh, from shapes only.

The planner is a pure function of a trainer class, its config, a :class:`ShardingPolicy` and a
device count. It builds the trainer on a :class:`jax.sharding.AbstractMesh` of the target shape
(no devices, nothing allocated: the trainer's state is ``jax.eval_shape`` only), so a model of
billions of parameters plans for hundreds of devices in seconds on a laptop. It reports:

- one row per parameter (identical rows grouped): path, global shape, logical names, the
  compute / storage / update ``PartitionSpec`` and the per-device shard of each;
- per-device bytes of the model state — parameters as stored, the float32 gradient accumulator
  (parameter-shaped, in the storage layout), the optimizer state (parameter-shaped state in the
  update layout, counters replicated) — for the chosen policy and, side by side, for every other
  valid policy on the same devices;
- the closed-form ZeRO model for fp32 AdamW (tp=1) with the exact gap explained by the tensors
  the plan leaves replicated across ``batch``;
- the share of parameters the plan's ZeRO rules leave replicated across ``batch``, naming the
  largest such tensors when it exceeds 2%;
- the pre-flight verdict: for the chosen policy, the error constructing the trainer raises (the
  same as a training run); for the policies side by side, the same checks in the same order
  (mesh, batch plan, layout check) run on the shared abstract state, which is much faster;
- optionally (``compile=True``) the compiled train step's ``memory_analysis()`` on real
  (simulated) devices, activations included.

Communication order (used by :func:`plan_for_budget` to pick "the least communication that
fits"). Per step, with Ψ parameters and gradients of 4Ψ bytes, a ring collective moves about
(N−1)/N of its buffer per device:

1. DP (``zero=False``): the gradients are all-reduced over ``batch`` — the baseline.
2. ZeRO: the same gradient reduction, then each replica updates its slice and the updated
   parameters are all-gathered back to the replicated storage layout: one parameter all-gather
   more than DP.
3. FSDP: stored parameters are gathered over ``batch`` to run every microbatch (forward, and
   again in backward unless kept), and gradients are reduce-scattered: about 1.5× ZeRO's volume
   (the ZeRO paper's 3Ψ against 2Ψ), growing with accumulation steps.
4. Any ``tp > 1``: activations are combined inside every layer, forward and backward, for every
   microbatch; this scales with tokens rather than parameters and is latency-bound, so every TP
   policy ranks after every ``tp=1`` policy, smaller ``tp`` first, and within one ``tp`` the
   order DP < ZeRO < FSDP above.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from theseus.base.axis import MESH_AXES, PHASES, Axis, Phase, ShardingPolicy, partition_spec
from theseus.base.layout import (
    LayoutError,
    check_layouts,
    is_sharding,
    optimizer_layout,
    resolve_layouts,
    shard_shape,
)
from theseus.base.topology import Topology
from theseus.collectives import OPS, Collectives, count_collectives
from theseus.config import apply_overrides
from theseus.training.base import BaseTrainer, TrainerConfig, plan_batch
from theseus.training.memory import shard_bytes

#: Above this share of parameters replicated across ``batch``, the largest such tensors are named.
REPLICATED_WARNING_SHARE = 0.02
#: Tensor parallelism stays within one host; without ``devices_per_host``, hosts have this many.
DEFAULT_DEVICES_PER_HOST = 8

_COMMUNICATION = {
    "DP": "all-reduce gradients over batch",
    "ZeRO": "DP + all-gather updated parameters over batch",
    "FSDP": "ZeRO + gather parameters over batch for every microbatch",
}


# --- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryTotals:
    """Per-device bytes of the persistent model state of one policy (activations not included)."""

    params: int
    grad_accumulator: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grad_accumulator + self.optimizer

    def to_json(self) -> dict:
        return {
            "params_bytes": self.params,
            "grad_accumulator_bytes": self.grad_accumulator,
            "optimizer_bytes": self.optimizer,
            "total_bytes": self.total,
        }


@dataclass(frozen=True)
class PlanRow:
    """One parameter, or a group of parameters identical in shape, names and layouts."""

    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...] | None
    compute_spec: PartitionSpec
    storage_spec: PartitionSpec
    update_spec: PartitionSpec
    compute_shard: tuple[int, ...]
    storage_shard: tuple[int, ...]
    update_shard: tuple[int, ...]
    replicated_over_batch: bool  # the plan's TP+ZeRO rules leave it whole across `batch`
    problems: tuple[str, ...] = ()  # dims a layout cannot divide (shards shown rounded up)

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
        return getattr(self, f"{phase}_spec")

    def shard(self, phase: Phase) -> tuple[int, ...]:
        return getattr(self, f"{phase}_shard")

    def to_json(self) -> dict:
        return {
            "paths": list(self.paths),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "names": None if self.names is None else list(self.names),
            "specs": {p: spec_json(self.spec(p)) for p in PHASES},
            "shard_shapes": {p: list(self.shard(p)) for p in PHASES},
            "params": self.num_params,
            "replicated_over_batch": self.replicated_over_batch,
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class Verdict:
    """The pre-flight verdict: ``error`` is the exact message a training run would raise; when
    that is not a layout error, ``also`` is the layout check's error that would follow it."""

    ok: bool
    error: str | None = None
    also: str | None = None
    gathering: str | None = None  # how the step gathers parameters stored split over batch

    @property
    def summary(self) -> str:
        return "ok" if self.ok else self.error.splitlines()[0]

    def to_json(self) -> dict:
        return {"ok": self.ok, "error": self.error, "also": self.also, "gathering": self.gathering}


@dataclass(frozen=True)
class PolicyOption:
    """One policy on the same devices: its mesh, model-state totals, verdict and rank in the
    communication order (0 = least; see the module docstring)."""

    policy: ShardingPolicy
    mesh_shape: dict[str, int]
    totals: MemoryTotals | None  # None when a layout cannot hold some tensor
    verdict: Verdict
    rank: int
    closed_form: ClosedForm | None = None  # tp=1 with fp32 AdamW only

    @property
    def name(self) -> str:
        return policy_name(self.policy)

    @property
    def communication(self) -> str:
        return communication(self.policy)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "policy": self.policy.model_dump(),
            "mesh": dict(self.mesh_shape),
            "totals": None if self.totals is None else self.totals.to_json(),
            "verdict": self.verdict.to_json(),
            "communication_rank": self.rank,
            "communication": self.communication,
            "closed_form": None if self.closed_form is None else self.closed_form.to_json(),
        }


@dataclass(frozen=True)
class ReplicatedShare:
    """Parameters the plan's TP+ZeRO rules leave whole across ``batch`` (ZeRO and FSDP cannot
    partition them); ``largest`` names the biggest such tensors when the share exceeds 2%."""

    num_params: int
    total_params: int
    largest: tuple[tuple[str, tuple[int, ...], int], ...]  # (path, shape, parameters)

    @property
    def fraction(self) -> float:
        return self.num_params / self.total_params if self.total_params else 0.0

    def to_json(self) -> dict:
        return {
            "params": self.num_params,
            "total_params": self.total_params,
            "fraction": self.fraction,
            "largest": [
                {"path": path, "shape": list(shape), "params": n} for path, shape, n in self.largest
            ],
        }


@dataclass(frozen=True)
class ClosedForm:
    """The ZeRO paper's model-state bytes for fp32 AdamW (tp=1), against the planner's total.

    DP ``16Ψ``; ZeRO ``8Ψ + 8Ψ/N``; FSDP ``16Ψ/N`` (Ψ parameters, N data replicas). The
    planner's total exceeds it by exactly ``explained_gap``: each of the ``replicated_params``
    (in tensors the plan leaves whole across ``batch``) keeps all ``bytes_per_replicated_param``
    of its partitioned state on every device instead of 1/N of them, plus the optimizer's
    non-parameter state (step counters).
    """

    kind: str
    formula: str
    psi: int
    replicas: int
    predicted_bytes: float
    planner_bytes: int
    replicated_params: int
    bytes_per_replicated_param: int
    non_param_optimizer_bytes: int

    @property
    def gap(self) -> float:
        return self.planner_bytes - self.predicted_bytes

    @property
    def explained_gap(self) -> float:
        n = self.replicas
        spread = self.bytes_per_replicated_param * self.replicated_params * (n - 1) / n
        return spread + self.non_param_optimizer_bytes

    def to_json(self) -> dict:
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "gap_bytes": self.gap,
            "explained_gap_bytes": self.explained_gap,
        }


@dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes of the compiled train step (``memory_analysis()``), activations included.

    ``peak`` is the sum of arguments, temporaries and outputs; ``aliased`` of the output bytes
    reuse donated argument buffers, so the sum is an upper bound by that much. ``executable`` is
    the compiled step itself (callable on a state in the trainer's layouts; its HLO is
    ``executable.as_text()``); it is not part of the JSON. ``collectives``: per device per step,
    loops unrolled (:mod:`theseus.collectives`).
    """

    arguments: int
    temporaries: int
    outputs: int
    aliased: int
    collectives: Collectives = dataclasses.field(default_factory=Collectives)
    executable: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def peak(self) -> int:
        return self.arguments + self.temporaries + self.outputs

    def to_json(self) -> dict:
        return {
            "argument_bytes": self.arguments,
            "temp_bytes": self.temporaries,
            "output_bytes": self.outputs,
            "alias_bytes": self.aliased,
            "peak_bytes": self.peak,
            "collectives": self.collectives.to_json(),
        }


@dataclass(frozen=True)
class BudgetChoice:
    """Which policy ``plan_for_budget`` picked for ``budget`` bytes per device, and why not the
    others (``reasons``: policy name → reason, in communication order)."""

    budget: int
    measure: str  # "model state" or "compiled peak"
    chosen: str
    reasons: tuple[tuple[str, str], ...]

    def to_json(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "measure": self.measure,
            "chosen": self.chosen,
            "reasons": [{"policy": name, "reason": why} for name, why in self.reasons],
        }


@dataclass(frozen=True)
class Plan:
    """Everything ``theseus plan`` shows; :meth:`render` is the text, :meth:`to_json` the JSON."""

    trainer: str
    num_params: int
    num_devices: int
    devices_per_host: int
    mesh_shape: dict[str, int]
    policy: ShardingPolicy
    batch: str | None
    rows: tuple[PlanRow, ...]
    totals: MemoryTotals | None
    verdict: Verdict
    replicated: ReplicatedShare
    closed_form: ClosedForm | None
    options: tuple[PolicyOption, ...]
    compiled: CompiledMemory | None = None
    budget: BudgetChoice | None = None

    @property
    def name(self) -> str:
        return policy_name(self.policy)

    def option(self, name: str) -> PolicyOption:
        for option in self.options:
            if option.name == name:
                return option
        raise KeyError(f"no policy named {name!r}; plans have {[o.name for o in self.options]}")

    def to_json(self) -> dict:
        return {
            "trainer": self.trainer,
            "num_params": self.num_params,
            "num_devices": self.num_devices,
            "devices_per_host": self.devices_per_host,
            "mesh": dict(self.mesh_shape),
            "policy": {"name": self.name, **self.policy.model_dump()},
            "batch": self.batch,
            "rows": [row.to_json() for row in self.rows],
            "totals": None if self.totals is None else self.totals.to_json(),
            "verdict": self.verdict.to_json(),
            "replicated": self.replicated.to_json(),
            "closed_form": None if self.closed_form is None else self.closed_form.to_json(),
            "policies": [option.to_json() for option in self.options],
            "compiled": None if self.compiled is None else self.compiled.to_json(),
            "budget": None if self.budget is None else self.budget.to_json(),
        }

    def render(self) -> str:
        return _render(self)


# --- policies ---------------------------------------------------------------------------------


def policy_kind(policy: ShardingPolicy) -> str:
    return "FSDP" if policy.fsdp else "ZeRO" if policy.zero else "DP"


def policy_name(policy: ShardingPolicy) -> str:
    """``DP``, ``ZeRO`` or ``FSDP``, with `` tp=K`` when tensor parallel."""
    kind = policy_kind(policy)
    return kind if policy.tp == 1 else f"{kind} tp={policy.tp}"


def communication(policy: ShardingPolicy) -> str:
    text = _COMMUNICATION[policy_kind(policy)]
    return text if policy.tp == 1 else f"{text}; activations within every layer over tp={policy.tp}"


def communication_key(policy: ShardingPolicy) -> tuple[int, int]:
    """Sort key of the communication order: tp first, then DP < ZeRO < FSDP."""
    return policy.tp, ("DP", "ZeRO", "FSDP").index(policy_kind(policy))


def resolve_devices_per_host(num_devices: int, devices_per_host: int | None) -> int:
    if num_devices < 1:
        raise ValueError(f"cannot plan for {num_devices} devices; give a positive device count.")
    if devices_per_host is None:
        return min(num_devices, DEFAULT_DEVICES_PER_HOST)
    if devices_per_host < 1 or num_devices % devices_per_host:
        raise ValueError(
            f"devices per host {devices_per_host} must be positive and divide the {num_devices} "
            "devices (every host has the same number)."
        )
    return devices_per_host


def candidate_policies(
    num_devices: int,
    devices_per_host: int | None = None,
    *,
    activation_checkpointing: bool = False,
) -> list[ShardingPolicy]:
    """Every policy the mesh allows, least communication first: each ``tp`` dividing the devices
    of one host, with DP, ZeRO and FSDP."""
    per_host = resolve_devices_per_host(num_devices, devices_per_host)
    policies = [
        ShardingPolicy(
            tp=tp, zero=zero, fsdp=fsdp, activation_checkpointing=activation_checkpointing
        )
        for tp in range(1, per_host + 1)
        if per_host % tp == 0
        for zero, fsdp in ((False, False), (True, False), (True, True))
    ]
    return sorted(policies, key=communication_key)


def abstract_topology(
    policy: ShardingPolicy, num_devices: int, devices_per_host: int | None = None
) -> Topology:
    """A :class:`Topology` on an ``AbstractMesh`` of ``num_devices``: shapes only, no devices."""
    per_host = resolve_devices_per_host(num_devices, devices_per_host)
    if per_host % policy.tp:
        divisors = ", ".join(str(k) for k in range(1, per_host + 1) if per_host % k == 0)
        raise ValueError(
            f"tp={policy.tp} does not divide the {per_host} devices of one host: a "
            f"tensor-parallel group must stay within one host. Choose a tp that divides "
            f"{per_host} (e.g. {divisors}), or give the devices per host."
        )
    shape = (num_devices // policy.tp, policy.tp)
    mesh = AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return Topology(mesh=mesh, policy=policy)


# --- model-state arithmetic -------------------------------------------------------------------


def _float32_like(tree: Any) -> Any:
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), tree)


def model_state_totals(
    trainer: BaseTrainer, policy: ShardingPolicy | None = None, mesh: Any = None
) -> MemoryTotals:
    """Per-device bytes of parameters (storage layout), the float32 gradient accumulator (storage
    layout) and the optimizer state (parameter-shaped state in the update layout, the rest
    replicated) of ``trainer``'s abstract state.

    Without ``policy``/``mesh`` these are the trainer's own layouts (as
    :meth:`BaseTrainer.memory_facts` predicts); with them, the layouts that policy would give on
    that mesh (real or abstract), after the same check (raises :class:`LayoutError`).
    """
    abstract = trainer.abstract_state
    if policy is None and mesh is None:
        storage, opt_layout = trainer.layouts.storage, trainer.state_layout.opt_state
    else:
        policy = trainer.policy if policy is None else policy
        mesh = trainer.mesh if mesh is None else mesh
        check_layouts(trainer.abstract_params, trainer.plan, policy, mesh)
        annotated = resolve_layouts(trainer.abstract_params, trainer.plan, policy, mesh)
        storage = nnx.to_pure_dict(annotated.storage)
        update = nnx.to_pure_dict(annotated.update)
        opt_layout = optimizer_layout(trainer.optimizer, abstract.opt_state, update, mesh)
    return MemoryTotals(
        params=shard_bytes(abstract.params, storage),
        grad_accumulator=shard_bytes(_float32_like(abstract.params), storage),
        optimizer=shard_bytes(abstract.opt_state, opt_layout),
    )


def _non_param_optimizer_bytes(trainer: BaseTrainer) -> int:
    """Bytes of the optimizer state that is not parameter-shaped (counters; kept replicated)."""
    rest = optax.tree_map_params(
        trainer.optimizer,
        lambda _: None,
        trainer.abstract_state.opt_state,
        transform_non_params=lambda x: x,
    )
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(rest))


def _param_shaped_optimizer_bytes(trainer: BaseTrainer) -> int:
    total = sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(trainer.abstract_state.opt_state)
    )
    return total - _non_param_optimizer_bytes(trainer)


def _dims(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _shard(
    shape: tuple[int, ...], spec: PartitionSpec, mesh_shape: dict[str, int]
) -> tuple[tuple[int, ...], list[str]]:
    """The per-device shard (rounded up where a dim does not divide) and what does not divide."""
    shard, problems = list(shape), []
    for dim, entry in enumerate(tuple(spec)):
        axes = _dims(entry)
        pieces = math.prod(mesh_shape[a] for a in axes)
        if shape[dim] % pieces:
            split = " × ".join(f"{a}={mesh_shape[a]}" for a in axes)
            problems.append(
                f"dim {dim} of size {shape[dim]} does not divide into {pieces} ({split})"
            )
        shard[dim] = -(-shape[dim] // pieces)
    return tuple(shard), problems


def _uses_batch(spec: PartitionSpec) -> bool:
    return any(Axis.BATCH in _dims(entry) for entry in tuple(spec))


def plan_rows(
    trainer: BaseTrainer, policy: ShardingPolicy, mesh_shape: dict[str, int]
) -> tuple[PlanRow, ...]:
    """One row per parameter of ``trainer``'s abstract state, identical rows grouped."""
    merged = trainer.plan.merged()
    groups: dict[tuple, list[str]] = {}
    for leaf in trainer.abstract_leaves:
        specs = tuple(partition_spec(leaf.names, trainer.plan.rules(policy, p)) for p in PHASES)
        key = (leaf.shape, str(np.dtype(leaf.dtype)), leaf.names, specs)
        groups.setdefault(key, []).append(leaf.path)
    rows = []
    for (shape, dtype, names, specs), paths in groups.items():
        shards, problems = [], []
        for phase, spec in zip(PHASES, specs, strict=True):
            shard, issues = _shard(shape, spec, mesh_shape)
            shards.append(shard)
            problems += [f"{phase}: {issue}" for issue in issues]
        rows.append(
            PlanRow(
                paths=tuple(paths),
                shape=shape,
                dtype=dtype,
                names=names,
                compute_spec=specs[0],
                storage_spec=specs[1],
                update_spec=specs[2],
                compute_shard=shards[0],
                storage_shard=shards[1],
                update_shard=shards[2],
                replicated_over_batch=not _uses_batch(partition_spec(names, merged)),
                problems=tuple(problems),
            )
        )
    return tuple(rows)


def replicated_share(trainer: BaseTrainer) -> ReplicatedShare:
    """Parameters whose TP+ZeRO layout leaves them whole across ``batch``."""
    merged = trainer.plan.merged()
    replicated = [
        (leaf.path, leaf.shape, math.prod(leaf.shape))
        for leaf in trainer.abstract_leaves
        if not _uses_batch(partition_spec(leaf.names, merged))
    ]
    count = sum(n for _, _, n in replicated)
    share = ReplicatedShare(count, trainer.num_params, ())
    if share.fraction <= REPLICATED_WARNING_SHARE:
        return share
    largest = tuple(sorted(replicated, key=lambda r: (-r[2], r[0]))[:5])
    return ReplicatedShare(count, trainer.num_params, largest)


def closed_form(
    trainer: BaseTrainer, policy: ShardingPolicy, replicas: int, totals: MemoryTotals | None
) -> ClosedForm | None:
    """The ZeRO paper's model for fp32 AdamW at tp=1, or None where it does not apply (tp > 1,
    a layout that cannot be placed, parameters not float32, or not two float32 moments each)."""
    psi = trainer.num_params
    float32_params = all(np.dtype(leaf.dtype) == np.float32 for leaf in trainer.abstract_leaves)
    adam_like = _param_shaped_optimizer_bytes(trainer) == 8 * psi
    if policy.tp != 1 or totals is None or not (float32_params and adam_like):
        return None
    kind = policy_kind(policy)
    n = replicas
    formula, predicted, per_param = {
        "DP": ("16Ψ", 16 * psi, 0),
        "ZeRO": ("8Ψ + 8Ψ/N", 8 * psi + 8 * psi / n, 8),
        "FSDP": ("16Ψ/N", 16 * psi / n, 16),
    }[kind]
    return ClosedForm(
        kind=kind,
        formula=formula,
        psi=psi,
        replicas=n,
        predicted_bytes=float(predicted),
        planner_bytes=totals.total,
        replicated_params=replicated_share(trainer).num_params,
        bytes_per_replicated_param=per_param,
        non_param_optimizer_bytes=_non_param_optimizer_bytes(trainer),
    )


# --- the planner ------------------------------------------------------------------------------


def _shape_trainer(
    trainer_class: type[BaseTrainer], config: TrainerConfig, policy: ShardingPolicy
) -> BaseTrainer:
    """The trainer on a one-device abstract mesh: the abstract state, whatever the mesh.

    Layout checks cannot fail on one device; the batch is reduced to one replica's share if it
    does not divide, since only shapes are read from this trainer. Config errors still raise.
    """
    probe = policy.merge(tp=1)
    training = config.training
    if training.batch_size % training.per_device_batch_size:
        config = apply_overrides(config, [f"training.batch_size={training.per_device_batch_size}"])
    return trainer_class(config, probe, abstract_topology(probe, 1))


def _option(
    trainer_class: type[BaseTrainer],
    config: TrainerConfig,
    shapes: BaseTrainer,
    policy: ShardingPolicy,
    num_devices: int,
    devices_per_host: int,
    rank: int,
    *,
    build: bool,
) -> tuple[PolicyOption, BaseTrainer | None]:
    """One policy's mesh, totals and verdict.

    With ``build``, the verdict is whatever constructing the trainer on the abstract mesh raises
    (exactly what a training run raises). Without it (the side-by-side policies), the same checks
    the constructor runs, in its order — the mesh, the batch plan, the layout check — run on the
    shape trainer's abstract state, which is much faster. When a non-layout error comes first,
    the layout check's error (if any) is kept as ``also``.
    """
    mesh_shape = {Axis.BATCH: num_devices // policy.tp, Axis.SHARD: policy.tp}
    try:
        topology = abstract_topology(policy, num_devices, devices_per_host)
    except ValueError as error:
        return PolicyOption(policy, mesh_shape, None, Verdict(False, str(error)), rank), None
    totals, layout_error, trainer, verdict = None, None, None, Verdict(True)
    try:
        totals = model_state_totals(shapes, policy, topology.mesh)
    except LayoutError as error:
        layout_error = str(error)
    if build:
        try:
            trainer = trainer_class(config, policy, topology)
        except ValueError as error:
            verdict = Verdict(False, str(error))
        else:
            totals = model_state_totals(trainer)
    else:
        try:
            plan_batch(config.training, topology, shapes.seq_len)
        except ValueError as error:
            verdict = Verdict(False, str(error))
        else:
            if layout_error is not None:
                verdict = Verdict(False, layout_error)
    if not verdict.ok and layout_error is not None and layout_error != verdict.error:
        verdict = Verdict(False, verdict.error, layout_error)
    zero_model = closed_form(shapes, policy, mesh_shape[Axis.BATCH], totals)
    return PolicyOption(policy, mesh_shape, totals, verdict, rank, zero_model), trainer


def plan(
    trainer_class: type[BaseTrainer],
    config: TrainerConfig,
    policy: ShardingPolicy,
    num_devices: int,
    *,
    devices_per_host: int | None = None,
    compile: bool = False,
    alternatives: bool = True,
) -> Plan:
    """The plan of ``policy`` on ``num_devices`` devices, with every other policy side by side
    (``alternatives=False``: this policy alone, which is faster).

    Works from abstract shapes only; nothing the size of the model is allocated. ``compile=True``
    also compiles the real train step on the first ``num_devices`` devices of this process and
    adds its ``memory_analysis()`` (only when the verdict is ok). Raises ``ValueError`` for bad
    input (an invalid config, a device count that cannot be meshed); a policy that fails the
    pre-flight check is not an error here but the plan's ``verdict``.
    """
    if not isinstance(config, trainer_class.config_class):
        raise TypeError(
            f"{trainer_class.__name__} plans a {trainer_class.config_class.__name__}, got "
            f"{type(config).__name__}"
        )
    per_host = resolve_devices_per_host(num_devices, devices_per_host)
    if num_devices % policy.tp:
        raise ValueError(
            f"tp={policy.tp} does not divide {num_devices} devices; the mesh is "
            f"(devices / tp, tp). Choose a tp that divides {num_devices}."
        )
    shapes = _shape_trainer(trainer_class, config, policy)
    candidates = candidate_policies(
        num_devices, per_host, activation_checkpointing=policy.activation_checkpointing
    )
    if not alternatives:
        candidates = [policy]
    elif policy not in candidates:
        candidates = sorted([*candidates, policy], key=communication_key)
    options, chosen, trainer = [], None, None
    for rank, candidate in enumerate(candidates):
        option, built = _option(
            trainer_class,
            config,
            shapes,
            candidate,
            num_devices,
            per_host,
            rank,
            build=candidate == policy,
        )
        options.append(option)
        if candidate == policy:
            chosen, trainer = option, built
    mesh_shape = chosen.mesh_shape
    compiled = None
    if compile and chosen.verdict.ok:
        compiled = compiled_memory(_device_trainer(trainer_class, config, policy, num_devices))
    return Plan(
        trainer=trainer_class.__name__,
        num_params=shapes.num_params,
        num_devices=num_devices,
        devices_per_host=per_host,
        mesh_shape=mesh_shape,
        policy=policy,
        batch=None if trainer is None else trainer.batch_plan.describe(),
        rows=plan_rows(shapes, policy, mesh_shape),
        totals=chosen.totals,
        verdict=dataclasses.replace(chosen.verdict, gathering=gathering(trainer)),
        replicated=replicated_share(shapes),
        closed_form=chosen.closed_form,
        options=tuple(options),
        compiled=compiled,
    )


def gathering(trainer: BaseTrainer | None) -> str | None:
    """How the step gathers the parameters its storage layout splits over ``batch`` (None when
    none are, or no trainer was built): per layer inside the model's layer scan
    (:func:`theseus.scan_layers`), or all at once before the loss, with those temporary bytes."""
    if trainer is None:
        return None
    mesh_shape = dict(trainer.mesh.shape)
    per_layer, whole, whole_bytes = 0, 0, 0
    layouts = trainer.layouts
    for leaf, storage, compute in zip(
        trainer.abstract_leaves,
        jax.tree.leaves(layouts.storage, is_leaf=is_sharding),
        jax.tree.leaves(layouts.compute, is_leaf=is_sharding),
        strict=True,
    ):
        if storage.spec == compute.spec:
            continue
        if leaf.path in trainer.per_layer_paths:
            per_layer += 1
            continue
        whole += 1
        whole_bytes += math.prod(shard_shape(leaf, compute.spec, mesh_shape)) * 4  # float32
    if not per_layer and not whole:
        return None
    if not per_layer:
        return (
            f"{trainer.__class__.__name__} gathers all parameters at once: every microbatch moves "
            f"the {whole} tensors stored split over batch to the compute layout before the loss, "
            f"{_bytes(whole_bytes)} ({_num(whole_bytes)} bytes) of temporaries per device; run "
            "stacked layers with theseus.scan_layers to gather one layer at a time"
        )
    return (
        f"gathers {per_layer} stacked tensors one layer at a time inside the layer scan; "
        f"{whole} others whole where used, {_bytes(whole_bytes)} ({_num(whole_bytes)} bytes) "
        "per device"
    )


def plan_for_budget(
    trainer_class: type[BaseTrainer],
    config: TrainerConfig,
    num_devices: int,
    budget: int,
    *,
    devices_per_host: int | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> Plan:
    """The plan of the valid policy with the least communication whose per-device memory fits in
    ``budget`` bytes, saying why each other policy was not chosen.

    Memory is the model state (parameters, gradient accumulator, optimizer state); with
    ``compile=True`` a policy must also fit by its compiled peak (activations included), which
    compiles candidates in order until one fits. Raises ``ValueError`` listing every policy's
    reason when none fits.
    """
    if budget <= 0:
        raise ValueError(f"the memory budget must be positive; got {budget} bytes.")
    policies = candidate_policies(
        num_devices, devices_per_host, activation_checkpointing=activation_checkpointing
    )
    survey = plan(
        trainer_class, config, policies[0], num_devices, devices_per_host=devices_per_host
    )
    measure = "compiled peak" if compile else "model state"
    reasons: dict[str, str] = {}
    fitting: list[Plan] = []  # compiled plans that fit, ranked by their collectives
    for option in survey.options:
        if not option.verdict.ok:
            reasons[option.name] = f"invalid: {option.verdict.summary}"
            continue
        total = option.totals.total
        if total > budget:
            reasons[option.name] = f"model state needs {_bytes(total)} > budget"
            continue
        if fitting and not compile:  # uncompiled, the communication order decides
            reasons[option.name] = (
                f"fits ({_bytes(total)}) but communicates more than {fitting[0].name}"
            )
            continue
        candidate = survey
        if compile or option.policy != survey.policy:
            candidate = plan(
                trainer_class,
                config,
                option.policy,
                num_devices,
                devices_per_host=devices_per_host,
                compile=compile,
            )
        if not candidate.verdict.ok:
            reasons[option.name] = f"invalid: {candidate.verdict.summary}"
            continue
        if compile and candidate.compiled.peak > budget:
            reasons[option.name] = f"compiled peak needs {_bytes(candidate.compiled.peak)} > budget"
            continue
        fitting.append(candidate)
    # Compiled, the least collective bytes per step wins (ties: the communication order).
    chosen = min(fitting, key=_communicated, default=None)
    for candidate in fitting:
        reasons[candidate.name] = (
            f"chosen: {measure} {_bytes(_measure(candidate))} fits"
            if candidate is chosen
            else f"fits ({_bytes(_measure(candidate))}) but its step moves "
            f"{_bytes(_communicated(candidate))} of collectives, more than {chosen.name}"
        )
    reasons = [(o.name, reasons[o.name]) for o in survey.options if o.name in reasons]
    if chosen is None:
        lines = "; ".join(f"{name}: {why}" for name, why in reasons)
        raise ValueError(
            f"no valid policy fits {num_devices} devices in {_bytes(budget)} per device "
            f"({measure}): {lines}. Add devices, raise the budget, or shrink the model "
            "(activation checkpointing lowers activations only)."
        )
    choice = BudgetChoice(budget, measure, chosen.name, tuple(reasons))
    return dataclasses.replace(chosen, budget=choice)


def _communicated(plan_: Plan) -> int:
    """Collective bytes per device per step when compiled; 0 otherwise (order decides)."""
    return plan_.compiled.collectives.bytes if plan_.compiled is not None else 0


def _measure(plan_: Plan) -> int:
    return plan_.compiled.peak if plan_.compiled is not None else plan_.totals.total


# --- compiling ahead of time ------------------------------------------------------------------


def _device_trainer(
    trainer_class: type[BaseTrainer], config: TrainerConfig, policy: ShardingPolicy, n: int
) -> BaseTrainer:
    available = jax.device_count()
    if n > available:
        raise ValueError(
            f"compiling for {n} devices needs {n} devices in this process, but JAX has "
            f"{available}. Run `theseus plan --compile --devices {n}` in a fresh process (it "
            f"simulates {n} CPU devices) or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts."
        )
    return trainer_class(config, policy, Topology.new(policy, devices=jax.devices()[:n]))


def compile_train_step(trainer: BaseTrainer) -> jax.stages.Compiled:
    """The trainer's real train step compiled ahead of time for its mesh (nothing allocated)."""
    bp = trainer.batch_plan
    shape = (bp.accumulation_steps, bp.examples_per_microbatch, bp.seq_len + 1)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=trainer.batch_sharding)
    return trainer.train_step.lower(trainer.abstract_state, batch).compile()


def compiled_memory(trainer_or_compiled: BaseTrainer | jax.stages.Compiled) -> CompiledMemory:
    """Per-device bytes of the compiled train step from ``memory_analysis()``."""
    compiled = trainer_or_compiled
    if isinstance(compiled, BaseTrainer):
        compiled = compile_train_step(compiled)
    stats = compiled.memory_analysis()
    return CompiledMemory(
        arguments=int(stats.argument_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        collectives=count_collectives(compiled.as_text()),
        executable=compiled,
    )


# --- the one-line plan of a run ---------------------------------------------------------------


def one_line_plan(trainer: BaseTrainer) -> str:
    """The plan of a constructed trainer in one line, for the start of a run: its policy and
    mesh, per-device model-state bytes, the same total for the other policies at its tp, and
    the share of parameters replicated across ``batch``."""
    totals = model_state_totals(trainer)
    others = []
    for kind in ("DP", "ZeRO", "FSDP"):
        other = trainer.policy.merge(zero=kind != "DP", fsdp=kind == "FSDP")
        if other == trainer.policy:
            continue
        try:
            others.append(f"{kind} {_bytes(model_state_totals(trainer, other).total)}")
        except LayoutError:
            others.append(f"{kind} invalid")
    share = replicated_share(trainer)
    mesh = " × ".join(f"{axis}={size}" for axis, size in trainer.topology.mesh_shape.items())
    named = ""
    if share.largest:
        named = " (largest: " + ", ".join(path for path, _, _ in share.largest[:3]) + ")"
    return (
        f"plan: {policy_name(trainer.policy)} on mesh {mesh}; per device "
        f"{_bytes(totals.params)} params + {_bytes(totals.grad_accumulator)} gradient sum + "
        f"{_bytes(totals.optimizer)} optimizer = {_bytes(totals.total)} "
        f"({', '.join(others)}); {_percent(share.fraction)} of parameters replicated across "
        f"batch{named}"
    )


# --- formatting -------------------------------------------------------------------------------

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_BYTES_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgtp]i?)?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``80GiB`` → 85899345920; ``80GB`` and ``80G`` are decimal; a plain number is bytes."""
    match = _BYTES_PATTERN.match(str(text))
    if not match:
        raise ValueError(
            f"{text!r} is not a byte count; write e.g. 80GiB (binary), 80GB (decimal) or "
            "85899345920."
        )
    number, unit = match.groups()
    unit = (unit or "").lower()
    scale = _BINARY[unit] if unit in _BINARY else _UNITS[unit]
    value = int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive byte count.")
    return value


def format_bytes(num: float) -> str:
    """Binary units to three significant digits: ``1.74 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= scale:
            value = num / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{num:.0f} B"


_bytes = format_bytes


def _percent(fraction: float) -> str:
    return f"{fraction:.2%}" if fraction >= 0.0001 or fraction == 0 else f"{fraction:.1e}"


def spec_json(spec: PartitionSpec) -> list:
    return [list(entry) if isinstance(entry, tuple) else entry for entry in tuple(spec)]


def group_path(paths: Sequence[str], width: int | None = None) -> str:
    """``blocks/{attn_q,attn_k}/kernel``: the paths' common leading and trailing segments once,
    the differing middles in braces; with ``width``, middles beyond it are elided (``…``) and the
    count given (``×6``)."""
    if len(paths) == 1:
        return paths[0]
    split = [p.split("/") for p in paths]
    shortest = min(len(s) for s in split)
    lead = 0
    while lead < shortest - 1 and len({s[lead] for s in split}) == 1:
        lead += 1
    trail = 0
    while trail < shortest - 1 - lead and len({s[-1 - trail] for s in split}) == 1:
        trail += 1
    middles = ["/".join(s[lead : len(s) - trail]) for s in split]
    head = "/".join(split[0][:lead])
    tail = "/".join(split[0][len(split[0]) - trail :]) if trail else ""

    def assemble(items: list[str]) -> str:
        middle = "{" + ",".join(items) + "}"
        return (head + "/" if head else "") + middle + ("/" + tail if tail else "")

    text = assemble(middles)
    if width is None or len(text) <= width:
        return text
    shown = list(middles)
    while len(shown) > 1 and len(assemble([*shown, "…"])) + 4 > width:
        shown.pop()
    return f"{assemble([*shown, '…'])} ×{len(paths)}"


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _names(names: Sequence[str | None] | None) -> str:
    return "-" if names is None else "(" + ", ".join(str(n) for n in names) + ")"


def _spec(spec: PartitionSpec) -> str:
    return str(spec)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = [indent + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for row in rows:
        cells = [str(c).ljust(w) for c, w in zip(row, widths, strict=True)]
        out.append(indent + "  ".join(cells).rstrip())
    return out


def _num(n: float) -> str:
    return f"{n:,.0f}"


def _render(p: Plan) -> str:
    mesh = " × ".join(f"{axis}={size}" for axis, size in p.mesh_shape.items())
    lines = [
        (
            f"plan: {p.trainer}, {_num(p.num_params)} parameters on {p.num_devices} devices "
            f"({p.devices_per_host} per host), mesh {mesh}"
        ),
        f"policy: {p.name} ({p.policy.describe()})",
    ]
    if p.batch:
        lines.append(p.batch)
    tensors = sum(len(r.paths) for r in p.rows)
    lines += ["", f"parameters ({tensors} tensors in {len(p.rows)} rows; shards are per device)"]
    header = ["path", "shape", "names", *PHASES, "shard compute / storage / update"]
    table = [
        [
            ("! " if r.problems else "") + group_path(r.paths, width=48),
            _shape(r.shape),
            _names(r.names),
            *(_spec(r.spec(phase)) for phase in PHASES),
            " / ".join(_shape(r.shard(phase)) for phase in PHASES),
        ]
        for r in p.rows
    ]
    lines += _table(header, table)
    if any(r.problems for r in p.rows):
        lines.append("  ! a layout of this policy cannot divide the tensor (shards rounded up)")

    lines += [
        "",
        (
            "per-device model state in bytes (parameters as stored, float32 gradient "
            "accumulator, optimizer state; activations not included)"
        ),
    ]
    header = ["", "policy", "mesh", "params", "gradient sum", "optimizer", "total", "", "verdict"]
    table = []
    for option in p.options:
        mark = "*" if option.policy == p.policy else ""
        mesh_o = f"{option.mesh_shape[Axis.BATCH]}×{option.mesh_shape[Axis.SHARD]}"
        if option.totals is None:
            cells = ["-", "-", "-", "-", ""]
        else:
            t = option.totals
            cells = [
                _num(t.params),
                _num(t.grad_accumulator),
                _num(t.optimizer),
                _num(t.total),
                format_bytes(t.total),
            ]
        summary = option.verdict.summary
        summary = summary if len(summary) <= 72 else summary[:71] + "…"
        table.append([mark, option.name, mesh_o, *cells, summary])
    lines += _table(header, table)
    lines.append(
        "  communication, least first: DP < ZeRO < FSDP at tp=1, then each tp > 1 in the same "
        "order (" + "; ".join(f"{k}: {v}" for k, v in _COMMUNICATION.items()) + ")"
    )

    cf = p.closed_form
    if cf is not None:
        lines += [
            "",
            (
                f"ZeRO model (fp32 AdamW, Ψ={_num(cf.psi)}, N={cf.replicas} replicas): "
                f"{cf.kind} {cf.formula} = {_num(cf.predicted_bytes)} bytes; planner "
                f"{_num(cf.planner_bytes)} (+{_num(cf.gap)}): {_num(cf.replicated_params)} "
                f"parameters in tensors left whole across batch keep "
                f"{cf.bytes_per_replicated_param} bytes each on every device "
                f"({cf.bytes_per_replicated_param} × {_num(cf.replicated_params)} × (1 − 1/N) = "
                f"{_num(cf.explained_gap - cf.non_param_optimizer_bytes)}) plus "
                f"{cf.non_param_optimizer_bytes} bytes of optimizer counters"
            ),
        ]

    r = p.replicated
    lines += [
        "",
        f"replicated across batch: {_percent(r.fraction)} of parameters ({_num(r.num_params)} of "
        f"{_num(r.total_params)}) are left whole on every replica by the plan's ZeRO rules"
        + ("" if p.policy.zero else " (zero=False replicates all optimizer state by choice)"),
    ]
    if r.largest:
        lines.append(
            f"  above {REPLICATED_WARNING_SHARE:.0%}; largest: "
            + ", ".join(f"{path} {_shape(shape)} ({_num(n)})" for path, shape, n in r.largest)
            + "; annotate them with logical names the ZeRO rules map to batch"
        )

    if p.compiled is not None:
        c = p.compiled
        lines += [
            "",
            (
                f"compiled train step, per device: arguments {_num(c.arguments)}, temporaries "
                f"{_num(c.temporaries)}, outputs {_num(c.outputs)} ({_num(c.aliased)} reuse "
                f"donated arguments); peak (sum) {_num(c.peak)} bytes = {format_bytes(c.peak)}"
            ),
            "collectives per device per step (loops unrolled):",
        ]
        lines += _table(
            ["collective", "count", "bytes", ""],
            [
                [
                    op,
                    _num(c.collectives[op].count),
                    _num(c.collectives[op].bytes),
                    format_bytes(c.collectives[op].bytes),
                ]
                for op in OPS
            ],
        )

    if p.budget is not None:
        b = p.budget
        lines += [
            "",
            f"budget {format_bytes(b.budget)} ({_num(b.budget)} bytes) per device, by "
            + f"{b.measure}: chose {b.chosen}, the least communication that fits",
        ]
        lines += [f"  {name}: {why}" for name, why in b.reasons]

    lines.append("")
    if p.verdict.ok:
        lines.append("verdict: ok (the pre-flight check of a training run passes)")
        if p.verdict.gathering:
            lines.append(f"  {p.verdict.gathering}")
    else:
        lines.append("verdict: FAILED, a training run would stop with:")
        lines += ["  " + line for line in p.verdict.error.splitlines()]
        if p.verdict.also:
            lines.append("and, once that is fixed, the layout check would stop it with:")
            lines += ["  " + line for line in p.verdict.also.splitlines()]
    return "\n".join(lines)
