"""Reading a run on the devices at hand: the trainer that reads it, and its validation loss.

A run is read under its own sharding policy merged with the user's changes. When the user
changes no layout setting and the run's policy does not fit the devices at hand (a tp that does
not divide them, a dimension FSDP or ZeRO cannot split), a policy that fits is derived, the
nearest first (:func:`fallback_policies`); one line names it. Numbers do not
depend on the layout, so reading under another one gives the run's own function.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from theseus.config import apply_overrides
from theseus.distributed.join import main_process_logger
from theseus.jobs import get_job, job_of_run
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.run.evaluation import evaluate as evaluate_checkpoint
from theseus.training.run.evaluation import run_config, score_text
from theseus.training.trainer import BaseTrainer, TrainerConfig

logger = main_process_logger(__name__)  # every process of a job reads alike: one says so

#: The policy fields a user changes with --tp, --zero/--no-zero and --fsdp/--no-fsdp.
LAYOUT_FIELDS = ("tp", "zero", "fsdp")


def fallback_policies(saved: ShardingPolicy) -> list[ShardingPolicy]:
    """Policies to read a run saved under ``saved`` with, nearest first: every tp dividing the
    run's (largest first), each with the run's FSDP and ZeRO settings, then without FSDP, then
    without ZeRO either (reading never updates, so ZeRO's layout is never used)."""
    found = []
    for tp in (t for t in range(saved.tp, 0, -1) if saved.tp % t == 0):
        for fsdp, zero in ((saved.fsdp, saved.zero), (False, saved.zero), (False, False)):
            policy = saved.merge(tp=tp, fsdp=fsdp, zero=zero)
            if policy not in found:
                found.append(policy)
    return found


def reading_trainer(
    trainer_class: type[BaseTrainer],
    config_for: Callable[[Topology], TrainerConfig],
    saved: ShardingPolicy,
    changes: dict[str, Any] | None,
    devices: Sequence[jax.Device] | None,
) -> BaseTrainer:
    """A trainer of ``trainer_class`` (config ``config_for(topology)``) under the run's policy
    ``saved`` merged with ``changes``; without layout ``changes``, the first policy of
    :func:`fallback_policies` that fits ``devices`` (default: all), named in one line."""
    changes = dict(changes or {})

    def build(policy: ShardingPolicy) -> BaseTrainer:
        topology = Topology.new(policy, devices)
        return trainer_class(config_for(topology), policy, topology)

    wanted = saved.merge(**changes)
    if set(changes) & set(LAYOUT_FIELDS):
        return build(wanted)  # the user's own layout: its errors are theirs to fix
    try:
        return build(wanted)
    except ValueError as error:
        reason = str(error).split(". ")[0].split(":")[0]
        for policy in fallback_policies(wanted)[1:]:
            try:
                trainer = build(policy)
            except ValueError:
                continue
            count = len(devices) if devices is not None else jax.device_count()
            logger.info(
                f"note: the run's layout ({wanted.describe()}) does not fit {count} device(s) "
                f"({reason}); reading it under {policy.describe()} (--tp, --zero/--no-zero, "
                "--fsdp/--no-fsdp choose another)"
            )
            return trainer
        raise


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate` returns (and writes to ``RUN_DIR/eval.json``)."""

    run_dir: str
    job: str
    step: int
    val_loss: float | None  # None: the data has no loss (an RL run's held-out prompts)
    val_loss_by_source: dict[str, float] | None
    policy: str
    metrics: dict[str, float] = field(default_factory=dict)  # the loss's others; RL's rewards

    def describe(self) -> str:
        return (
            f"evaluated {self.run_dir} at step {self.step}: "
            f"{score_text(self.val_loss, self.metrics)} ({self.job}, {self.policy}); written "
            f"to {self.run_dir}/eval.json"
        )


def evaluate(
    run_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    policy_changes: dict[str, Any] | None = None,
    devices: Sequence[jax.Device] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
) -> Evaluation:
    """Validation loss of the newest good checkpoint of ``run_dir`` (a training run or an
    imported model) on the run's own data and config (``config.yaml``; ``overrides`` on top,
    the model section excepted), under the run's policy (see :func:`reading_trainer`);
    written to ``run_dir/eval.json``. ``job`` names the run's job when it records none;
    ``base`` the base run of a fine-tuning run that moved apart from it."""
    run_dir = Path(run_dir)
    name = job or job_of_run(run_dir)
    trainer_class = get_job(name).trainer_class
    saved = run_config(trainer_class.config_class, run_dir)
    if saved is None:
        raise ValueError(f"{run_dir} holds no config.yaml: it is not a run directory")
    config = apply_overrides(saved, list(overrides))
    policy = ShardingPolicy(**_saved_policy(run_dir))
    chosen = any(o.startswith("training.per_device_batch_size=") for o in overrides)

    def config_for(topology: Topology) -> TrainerConfig:
        return config if chosen else batch_for_replicas(config, topology.replicas)

    trainer = reading_trainer(trainer_class, config_for, policy, policy_changes, devices)
    # Imported here: the generator's package (this one) is still initialising when
    # posttraining's modules import it.
    from theseus.posttraining.rl.rollouts import rollout_data

    base_dir = Path(base) if base else None
    data = rollout_data(trainer, run_dir, base_dir=base_dir)
    result = evaluate_checkpoint(trainer, run_dir, source_dir=run_dir, base_dir=base_dir, data=data)
    return Evaluation(
        str(run_dir),
        name,
        result.step,
        result.val_loss,
        result.val_loss_by_source,
        trainer.policy.describe(),
        result.metrics,
    )


def batch_for_replicas(config: TrainerConfig, replicas: int) -> TrainerConfig:
    """``config`` with a ``training.per_device_batch_size`` that splits ``training.batch_size``
    over ``replicas``: the run's own when it does, else the largest below it that does (the
    held-out examples, hence the loss, do not depend on the split; a batch that ``replicas``
    do not divide is left to the batch check, which names the numbers)."""
    training = config.training
    per_replica, rest = divmod(training.batch_size, replicas)
    if rest or per_replica % training.per_device_batch_size == 0:
        return config
    largest = min(training.per_device_batch_size, per_replica)
    per_device = max(d for d in range(1, largest + 1) if per_replica % d == 0)
    logger.info(
        f"note: training.per_device_batch_size={training.per_device_batch_size} does not split "
        f"the run's batch of {training.batch_size} over {replicas} replicas; evaluating with "
        f"{per_device} (the same examples; training.per_device_batch_size=N chooses another)"
    )
    return apply_overrides(config, [f"training.per_device_batch_size={per_device}"])


def _saved_policy(run_dir: Path) -> dict[str, Any]:
    """The sharding policy ``run.json`` records (none for a run without one: the defaults)."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    policy = record.get("policy") if isinstance(record, dict) else None
    return dict(policy) if isinstance(policy, dict) else {}
