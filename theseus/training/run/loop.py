"""The training loop: data in, steps dispatched, metrics read one step late, records and
checkpoints written (the run's records: :mod:`~theseus.training.run.records`; where it starts,
from which directory and state: :mod:`~theseus.training.run.start`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from theseus.checkpoint.checkpointer import Checkpointer
from theseus.distributed.join import describe_processes, is_main_process, main_process_logger
from theseus.training.flops import count_flops
from theseus.training.run.checkpointing import checkpoint_meta, saved_state
from theseus.training.run.dashboards import GuardedDashboard, keep_missed, missed_rows
from theseus.training.run.data import CorpusData, RunData
from theseus.training.run.metrics import MetricsWriter, Tracker
from theseus.training.run.mode import NEW_RUN, RunMode
from theseus.training.run.preemption import PreemptionWatch
from theseus.training.run.records import num_trained, write_run_record
from theseus.training.run.start import StartingPoint, started
from theseus.training.run.stops import NonFiniteGuard, Preempted
from theseus.training.run.tensorboard import MISSED_FILE, TENSORBOARD_DIR, TensorBoardWriter
from theseus.training.run.throughput import speedometer
from theseus.training.run.wandb_writer import RUN_ID_FILE, open_wandb, require_wandb
from theseus.training.state import TrainState, reference_of
from theseus.training.summary import one_line_plan
from theseus.training.trainer import BaseTrainer

logger = main_process_logger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What a finished training run reports."""

    out_dir: str
    first_step: int
    steps: int
    first_loss: float
    final_loss: float
    initial_val_loss: float
    final_val_loss: float | None
    seconds: float
    rewards: tuple[float, float] | None = None  # an RL run's first and final step's mean reward
    val_rewards: tuple[float, float] | None = None  # its held-out prompts', before and after

    def describe(self) -> str:
        if self.rewards is not None:  # an RL run: its rewards say more than its loss
            first, final = self.rewards
            scores = f"reward {first:.4f} → {final:.4f}"
            if self.val_rewards is not None:
                scores += f"; held-out reward {self.val_rewards[0]:.4f} → {self.val_rewards[1]:.4f}"
        else:
            val = f"{self.final_val_loss:.4f}" if self.final_val_loss is not None else "n/a"
            scores = (
                f"loss {self.first_loss:.4f} → {self.final_loss:.4f}; validation loss "
                f"{self.initial_val_loss:.4f} → {val}"
            )
        return (
            f"done: steps {self.first_step}-{self.steps} in {self.seconds:.1f} s; {scores}; "
            f"records in {self.out_dir}"
        )


#: What scores tasks on the live parameters during training (``evaluation.tasks``): given the
#: parameters (storage layout) and the step, the scores by name (``task/metric``).
Evaluator = Callable[[Any, int], dict[str, float]]


def train(
    trainer: BaseTrainer,
    out_dir: str | Path,
    *,
    mode: RunMode = NEW_RUN,
    evaluator: Evaluator | None = None,
    data: RunData | None = None,
) -> RunSummary:
    """Train to ``training.steps``, writing run records, metrics and checkpoints to ``out_dir``;
    ``evaluator`` scores the parameters every ``evaluation.interval`` steps and at the last.
    ``data``: what the steps read (default: the run's corpus, :class:`CorpusData`; RL's
    prompts and their rollouts are another).

    With ``mode.resume``, continue from the newest good checkpoint there: same data position,
    RNG and optimizer state, so the losses equal those of an uninterrupted run. Settings that
    would change those numbers are refused unless ``mode.allow_changes`` (see
    :mod:`theseus.training.run.start`).
    Raises a :class:`~theseus.training.run.stops.RunInterrupted` when the run stops early on
    purpose, :class:`~theseus.checkpoint.checkpointer.CheckpointWriteError` when a checkpoint
    cannot be written.
    """
    out_dir = Path(out_dir)
    config = trainer.config
    batch_plan = trainer.batch_plan
    require_wandb(config.logging.wandb)  # before anything is written
    trainer.check_backend()
    data = CorpusData.of(trainer) if data is None else data
    with started(trainer, out_dir, mode) as (checkpointer, start):
        data = data.prepared(start.state.params, out_dir)
        logger.info(describe_processes())  # the run's first line
        for change in start.changes:
            logger.info(f"resuming with a changed setting: {change.describe()}")
        if start.resumed_from is not None:
            logger.info(start.resumed_from)
        logger.info(batch_plan.describe())
        logger.info(one_line_plan(trainer))
        logger.info(
            f"model: {trainer.num_params:,} parameters ({num_trained(trainer):,} trained); "
            f"policy {trainer.policy.describe()}; "
            f"mesh {trainer.topology.mesh_shape}; data {data.description}"
        )
        compile_start = time.perf_counter()
        compiled = trainer.compile(
            data.batch_shape()
        )  # once, ahead of time: the loop calls its executable
        compile_time_s = time.perf_counter() - compile_start
        speed = speedometer(trainer, count_flops(trainer))
        write_run_record(
            trainer,
            out_dir,
            data=data,
            state=start.state,
            compiled=compiled,
            resumes=start.resumes,
            speed={"compile_time_s": compile_time_s, **speed.facts()},
        )
        initial = data.validate(start.state.params, reference_of(start.state))
        guard = NonFiniteGuard(
            config.training.nonfinite,
            config.training.max_skipped_steps,
            lambda: _next_move(checkpointer),
        )
        records: list[tuple[Tracker, str, Path]] = []  # a dashboard, its name, what it missed
        if config.logging.tensorboard and is_main_process():
            tensorboard = TensorBoardWriter(out_dir, config.model_dump(mode="json"))
            records.append((tensorboard, "TensorBoard", out_dir / TENSORBOARD_DIR / MISSED_FILE))
        if (wandb := open_wandb(config, out_dir, resume=mode.resume)) is not None:
            records.append((wandb, "W&B", out_dir / RUN_ID_FILE))
        trackers = [GuardedDashboard(t, name, missed=keep_missed(r)) for t, name, r in records]
        metrics = MetricsWriter(
            out_dir / "metrics.jsonl",
            trainer,
            speed,
            first_step=start.first_step,
            trackers=trackers,
            check_row=guard.check,
        )
        began = time.perf_counter()
        with contextlib.ExitStack() as closing, metrics:  # trackers close after the last row
            for tracker, (_, _, record) in zip(trackers, records, strict=True):
                closing.enter_context(tracker)
                if mode.resume:  # what it missed in an earlier segment
                    for row in missed_rows(record, out_dir / "metrics.jsonl", start.first_step):
                        tracker.write(row)
            preemption = closing.enter_context(PreemptionWatch())
            _steps(
                trainer,
                step_fn=compiled.executable,
                start=start,
                data=data,
                checkpointer=checkpointer,
                metrics=metrics,
                preemption=preemption,
                evaluator=evaluator,
            )
        seconds = time.perf_counter() - began
        checkpointer.wait()
    history = metrics.history
    losses, val_losses = history.losses, history.val_losses
    initial_val_loss = initial.loss
    initial_reward = jax.device_get(initial.means).get("reward")
    return RunSummary(
        out_dir=str(out_dir),
        first_step=start.first_step,
        steps=config.training.steps,
        first_loss=losses[0] if losses else float("nan"),
        final_loss=losses[-1] if losses else float("nan"),
        initial_val_loss=float("nan") if initial_val_loss is None else float(initial_val_loss),
        final_val_loss=val_losses[-1] if val_losses else None,
        seconds=seconds,
        rewards=(history.rewards[0], history.rewards[-1]) if history.rewards else None,
        val_rewards=(
            (float(initial_reward), history.val_rewards[-1])
            if initial_reward is not None and history.val_rewards
            else None
        ),
    )


def _steps(
    trainer: BaseTrainer,
    *,
    step_fn: Callable[[TrainState, jax.Array], tuple[TrainState, dict]],
    start: StartingPoint,
    data: RunData,
    checkpointer: Checkpointer,
    metrics: MetricsWriter,
    preemption: PreemptionWatch,
    evaluator: Evaluator | None,
) -> None:
    """The hot loop: dispatch step n, record step n - 1 (already computed), then make step
    n + 1's batch while step n runs (a batch that needs step n's state, an RL rollout, waits
    for it).

    Validation and saves run with the metrics' clock paused, after step n - 1 is recorded, and
    the next batch is ready before the clock restarts, so each row times its own step. At a
    checkpoint step, step n's own metrics are read before its save (which waits for step n
    anyway), so a state after a non-finite step is never saved. On a preemption notice the step
    that all processes agreed on is saved, and the run stops.
    """
    training = trainer.config.training
    state, position = start.state, start.data_position
    batch = data.batch(start.first_step, position, state)
    for step in range(start.first_step, training.steps + 1):
        state, step_metrics = step_fn(state, batch.rows)
        metrics.push(step, step_metrics, batch.metrics)
        position += trainer.batch_plan.global_batch_size
        last = step == training.steps
        if not last:
            batch = data.batch(step + 1, position, state)  # the next step's, while this runs
        if step % training.validation_interval == 0 or last:
            with metrics.paused():
                metrics.add_validation(data.validate(state.params, reference_of(state)))
        if evaluator is not None and (step % trainer.config.evaluation.interval == 0 or last):
            with metrics.paused():
                metrics.add_scores(_scores(evaluator, state.params, step))
        preempted = preemption.reached()
        if preempted or step % trainer.config.checkpointing.interval == 0 or last:
            with metrics.paused():
                metrics.flush()
                meta = checkpoint_meta(trainer, step=step, data_position=position, base=start.base)
                checkpointer.save(saved_state(trainer, state, start.base), meta)
        if preempted and not last:
            checkpointer.wait()
            raise Preempted(
                f"preempted (SIGTERM): finished step {step} of {training.steps} and saved "
                f"it in {checkpointer.step_directory(step)}; continue with --resume"
            )


def _scores(evaluator: Evaluator, params: Any, step: int) -> dict[str, float] | None:
    """The evaluator's scores of step ``step``, or None when it fails: a failing evaluation is
    reported and the training goes on (its checkpoints are not lost)."""
    try:
        return evaluator(params, step)
    except Exception as error:  # noqa: BLE001 - whatever the tasks raise, training goes on
        logger.warning(
            f"scoring evaluation.tasks at step {step} failed ({type(error).__name__}: "
            f"{error}); training goes on without these scores"
        )
        return None


def _next_move(checkpointer: Checkpointer) -> str:
    """What to do after a non-finite stop: the newest committed step (restore checks it)."""
    checkpointer.wait()
    step = checkpointer.latest_step()
    fix = "lower the learning rate or tighten optimization.grad_clip"
    if step is None:
        return f"No checkpoint was saved before it: {fix} and start again with --overwrite."
    return (
        f"The newest good checkpoint is {checkpointer.step_directory(step)} (step {step}): {fix} "
        "and continue from it with --resume --allow-changes."
    )
