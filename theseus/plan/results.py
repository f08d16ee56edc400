"""What the planner returns: dataclasses, written as JSON by :func:`theseus.accounting.records.as_json`
and as text by :func:`theseus.plan.render.render`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, overload

from theseus.accounting.activations import ActivationMemory
from theseus.accounting.memory import CompiledStep, MemoryTotals
from theseus.accounting.records import json_field
from theseus.accounting.text import number_text as _num
from theseus.plan.policies import communication
from theseus.plan.rollout import CompiledRollout, RolloutMemory
from theseus.sharding.axis import ShardingPolicy
from theseus.training.summary import PlanRow, ReplicatedShare


class NoPolicyFits(ValueError):
    """No valid policy fits the memory budget; the message gives every policy's reason."""


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
        return "ok" if self.ok else (self.error or "").splitlines()[0]


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

    json_properties: ClassVar[dict[str, str]] = {
        "gap": "gap_bytes",
        "explained_gap": "explained_gap_bytes",
    }

    @property
    def gap(self) -> float:
        return self.planner_bytes - self.predicted_bytes

    @property
    def explained_gap(self) -> float:
        n = self.replicas
        spread = self.bytes_per_replicated_param * self.replicated_params * (n - 1) / n
        return spread + self.non_param_optimizer_bytes

    def describe(self) -> str:
        per_param, replicated = self.bytes_per_replicated_param, self.replicated_params
        return (
            f"ZeRO model (fp32 AdamW, Ψ={_num(self.psi)}, N={self.replicas} replicas): "
            f"{self.kind} {self.formula} = {_num(self.predicted_bytes)} bytes; planner "
            f"{_num(self.planner_bytes)} (+{_num(self.gap)}): {_num(replicated)} parameters in "
            f"tensors left whole across batch keep {per_param} bytes each on every device "
            f"({per_param} × {_num(replicated)} × (1 − 1/N) = "
            f"{_num(self.explained_gap - self.non_param_optimizer_bytes)}) plus "
            f"{self.non_param_optimizer_bytes} bytes of optimizer counters"
        )


@dataclass(frozen=True)
class PolicyOption:
    """One policy on the same devices: its mesh, model-state totals, activation memory of one
    microbatch, an RL job's rollout, verdict and rank in the communication order (0 = least;
    see :mod:`theseus.plan.policies`)."""

    policy: ShardingPolicy
    mesh_shape: dict[str, int] = json_field("mesh")
    totals: MemoryTotals | None = None  # None when a layout cannot hold some tensor
    verdict: Verdict = Verdict(True)
    rank: int = json_field("communication_rank", default=0)
    closed_form: ClosedForm | None = None  # tp=1 with fp32 AdamW only
    activations: ActivationMemory | None = None  # None: the batch or the model is not known
    rollout: RolloutMemory | None = json_field("rollout", omit_none=True, default=None)  # RL

    json_properties: ClassVar[dict[str, str]] = {
        "name": "name",
        "communication": "communication",
        "total": "total_bytes",
    }

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def total(self) -> int | None:
        """Model state plus one microbatch's activations per device (the model state alone
        when the activations are not known; None when a layout cannot hold some tensor); an RL
        job's: the larger of its training step and its rollout."""
        return memory_sum(self.totals, self.activations, self.rollout)

    @property
    def communication(self) -> str:
        return communication(self.policy)


@overload
def memory_sum(
    totals: MemoryTotals,
    activations: ActivationMemory | None,
    rollout: RolloutMemory | None = None,
) -> int: ...


@overload
def memory_sum(
    totals: None, activations: ActivationMemory | None, rollout: RolloutMemory | None = None
) -> None: ...


def memory_sum(
    totals: MemoryTotals | None,
    activations: ActivationMemory | None,
    rollout: RolloutMemory | None = None,
) -> int | None:
    """Per-device bytes of the model state and one microbatch's activations (None: no model
    state, a layout cannot hold some tensor). With an RL job's ``rollout``: the larger of that
    training step (with its completion rows) and the generation, each on top of the parameters
    and optimizer state."""
    if totals is None:
        return None
    step = totals.total + (0 if activations is None else activations.total)
    if rollout is None:
        return step
    return max(step + rollout.batch, totals.persistent + rollout.generation)


class Reason(NamedTuple):
    policy: str
    reason: str


@dataclass(frozen=True)
class BudgetChoice:
    """Which policy ``plan_for_budget`` picked for ``budget`` bytes per device, and why not the
    others (``reasons``, in communication order)."""

    budget: int = json_field("budget_bytes")
    measure: str = json_field("measure")  # "model state and activations" or "compiled peak"
    chosen: str = json_field("chosen")
    reasons: tuple[Reason, ...] = ()


@dataclass(frozen=True)
class RematOption:
    """The compiled step of the plan's policy under one recompute policy
    (``activation_checkpointing``), per device per step: peak and temporary bytes, the FLOPs of
    its matmuls (recomputation included) and its all-gather bytes."""

    remat: str = json_field("activation_checkpointing")
    peak: int = json_field("peak_bytes")
    temporaries: int = json_field("temp_bytes")
    dot_flops: int = json_field("dot_flops")
    all_gather: int = json_field("all_gather_bytes")


@dataclass(frozen=True)
class Plan:
    """Everything ``theseus plan`` shows; :func:`~theseus.plan.render.render` is the text,
    :func:`~theseus.accounting.records.as_json` the JSON."""

    trainer: str
    num_params: int
    num_devices: int
    devices_per_host: int
    mesh_shape: dict[str, int] = json_field("mesh")
    policy: ShardingPolicy = json_field(None)  # written with its name, as `policy_record`
    batch: str | None = None
    rows: tuple[PlanRow, ...] = ()
    totals: MemoryTotals | None = None
    verdict: Verdict = Verdict(True)
    replicated: ReplicatedShare | None = None
    closed_form: ClosedForm | None = None
    options: tuple[PolicyOption, ...] = json_field("policies", default=())
    compiled: CompiledStep | None = None
    budget: BudgetChoice | None = None
    remat: tuple[RematOption, ...] = json_field("remat_policies", default=())
    activations: ActivationMemory | None = None
    device_memory: int | None = json_field("device_memory_bytes", default=None)
    rollout: RolloutMemory | None = json_field("rollout", omit_none=True, default=None)  # RL
    compiled_rollout: CompiledRollout | None = json_field(
        "compiled_rollout", omit_none=True, default=None
    )

    json_properties: ClassVar[dict[str, str]] = {
        "policy_record": "policy",
        "activation_bytes": "activation_bytes",
        "total": "total_bytes",
    }

    @property
    def activation_bytes(self) -> int | None:
        return None if self.activations is None else self.activations.total

    @property
    def total(self) -> int | None:
        """Model state plus one microbatch's activations per device (an RL job's: the larger
        of its training step and its rollout)."""
        return memory_sum(self.totals, self.activations, self.rollout)

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def policy_record(self) -> dict[str, Any]:
        return {"name": self.name, **self.policy.model_dump()}

    def option(self, name: str) -> PolicyOption:
        for option in self.options:
            if option.name == name:
                return option
        raise KeyError(f"no policy named {name!r}; plans have {[o.name for o in self.options]}")
