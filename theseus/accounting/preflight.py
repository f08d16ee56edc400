"""Batch accounting and the pre-flight check: what a trainer checks before anything is allocated.

The trainer constructor and the planner both call :func:`preflight`, so a plan's verdict is
exactly the error a training run gives, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from theseus.config import TrainingConfig
from theseus.sharding.axis import ShardingPlan, ShardingPolicy
from theseus.sharding.layout import check_layouts
from theseus.sharding.topology import Topology


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch of one step is split: per replica × replicas × accumulation.

    Tensor-parallel devices of one replica share its examples, so only replicas multiply them.
    """

    per_device_batch_size: int
    replicas: int
    accumulation_steps: int
    seq_len: int

    @property
    def examples_per_microbatch(self) -> int:
        return self.per_device_batch_size * self.replicas

    @property
    def global_batch_size(self) -> int:
        return self.examples_per_microbatch * self.accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def shape(self) -> tuple[int, int, int]:
        """The global batch of one step: (accumulation, examples, seq_len + 1) token ids."""
        return (self.accumulation_steps, self.examples_per_microbatch, self.seq_len + 1)

    def describe(self) -> str:
        return (
            f"batch: {self.per_device_batch_size} per replica × {self.replicas} replicas × "
            f"{self.accumulation_steps} accumulation steps = {self.global_batch_size} examples "
            f"of {self.seq_len} tokens per step"
        )


def check_context_length(training: TrainingConfig, context: int, key: str) -> None:
    """``training.seq_len`` fits the model's context length ``context`` (its config key ``key``)."""
    if training.seq_len is not None and training.seq_len > context:
        raise ValueError(
            f"training.seq_len={training.seq_len} exceeds {key}={context}; lower the sequence "
            f"length or raise {key}."
        )


def plan_batch(training: TrainingConfig, topology: Topology, seq_len: int) -> BatchPlan:
    """Derive accumulation steps from the global and per-device batch sizes, exactly."""
    per_step = training.per_device_batch_size * topology.replicas
    if training.batch_size % per_step:
        raise ValueError(
            f"training.batch_size={training.batch_size} cannot be split into microbatches of "
            f"training.per_device_batch_size={training.per_device_batch_size} × "
            f"{topology.replicas} replicas = {per_step} examples; make batch_size a multiple of "
            f"{per_step} or change per_device_batch_size."
        )
    return BatchPlan(
        training.per_device_batch_size,
        topology.replicas,
        training.batch_size // per_step,
        seq_len,
    )


def preflight(
    abstract_params: Any,
    plan: ShardingPlan,
    policy: ShardingPolicy,
    topology: Topology,
    training: TrainingConfig,
    seq_len: int,
) -> BatchPlan:
    """The checks before allocation, in order: batch accounting, then every layout of every
    parameter (:class:`~theseus.sharding.layout.LayoutError` lists all offending leaves)."""
    batch_plan = plan_batch(training, topology, seq_len)
    check_layouts(abstract_params, plan, policy, topology.mesh)
    return batch_plan
