"""The training loop: data in, steps dispatched, metrics read one step late, records and
checkpoints written; and evaluation of a run's newest checkpoint."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from theseus.accounting.memory import CompiledStep
from theseus.accounting.records import as_json
from theseus.checkpoint.checkpointer import Checkpointer
from theseus.checkpoint.meta import CHECKPOINTS
from theseus.config import save_yaml
from theseus.data import Mixture, MixtureSampler
from theseus.distributed.join import describe_processes, is_main_process
from theseus.training.flops import count_flops
from theseus.training.run.checkpointing import (
    base_record,
    checkpoint_meta,
    frozen_params,
    read_base_params,
    restore_params,
    restore_target,
    saved_state,
)
from theseus.training.run.data import Validation, load_data, train_batch, validation_array
from theseus.training.run.evaluation import check_same_model
from theseus.training.run.metrics import MetricsWriter
from theseus.training.run.mode import NEW_RUN, RunMode
from theseus.training.run.preemption import PreemptionWatch
from theseus.training.run.resume import Change, check_resume, resume_changes, resume_history
from theseus.training.run.stops import NonFiniteGuard, Preempted, failed_saves_stop_the_run
from theseus.training.run.tensorboard import TensorBoardWriter
from theseus.training.run.throughput import speedometer
from theseus.training.run.wandb_writer import open_wandb, require_wandb
from theseus.training.summary import layouts_text, one_line_plan
from theseus.training.trainer import BaseTrainer, TrainState


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

    def describe(self) -> str:
        val = f"{self.final_val_loss:.4f}" if self.final_val_loss is not None else "n/a"
        return (
            f"done: steps {self.first_step}-{self.steps} in {self.seconds:.1f} s; loss "
            f"{self.first_loss:.4f} → {self.final_loss:.4f}; validation loss "
            f"{self.initial_val_loss:.4f} → {val}; records in {self.out_dir}"
        )


@dataclass(frozen=True)
class EvalResult:
    """Validation loss of a checkpoint."""

    out_dir: str
    source: str
    step: int
    val_loss: float
    val_loss_by_source: dict[str, float] | None = None

    def describe(self) -> str:
        return (
            f"evaluated {self.source} at step {self.step}: validation loss {self.val_loss:.4f}; "
            f"written to {self.out_dir}/eval.json"
        )


def _silent(_: str) -> None:
    pass


def sync_processes(name: str) -> None:
    """Wait until every process of a multi-process run reaches this point."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def prepare_run_dir(out_dir: Path, mode: RunMode) -> None:
    """Check the run directory against ``mode`` (see :meth:`RunMode.runs_to_replace`), then clear
    a run it replaces.

    Every process checks before any of them writes (process 0 then clears an overwritten run),
    so the check never sees a run that this very job has begun.
    """
    replaced = mode.runs_to_replace(out_dir)
    sync_processes("theseus: run directory checked")
    if is_main_process():
        for path in replaced:  # none when resuming
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
    sync_processes("theseus: run directory ready")


def write_run_record(
    trainer: BaseTrainer,
    out_dir: Path,
    *,
    corpus: Mixture,
    state: TrainState,
    compiled: CompiledStep,
    resumes: list[dict],
    speed: dict,
) -> None:
    """``run.json``, ``config.yaml`` and ``layouts.txt`` (main process), from the trainer."""
    if not is_main_process():
        return
    record = {
        **trainer.execution_facts(),
        **speed,
        "num_params": trainer.num_params,
        "num_trained_params": _num_trained(trainer),
        "memory_per_device": {
            "predicted": as_json(trainer.memory()),
            "measured": as_json(trainer.measured_memory(state)),
        },
        "compiled_step_memory_per_device": as_json(compiled),
        "data": corpus.description,
        "resumes": resumes,
    }
    (out_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    save_yaml(trainer.config, out_dir / "config.yaml")
    if corpus.tokenizer is not None:  # `theseus generate` decodes with the run's own copy
        shutil.copyfile(corpus.tokenizer, out_dir / "tokenizer.json")
    (out_dir / "layouts.txt").write_text(layouts_text(trainer) + "\n")


def _num_trained(trainer: BaseTrainer) -> int:
    """Parameters the run trains: all but the frozen ones (finetune)."""
    frozen = trainer.partition.frozen
    return sum(math.prod(x.shape) for x in trainer.abstract_leaves if x.path not in frozen)


@dataclass(frozen=True)
class StartingPoint:
    """Where a run (or a resumed run segment) begins; a resumed one says from where, with which
    changed settings, and the run's resume history."""

    state: TrainState
    first_step: int
    data_position: int
    resumed_from: str | None = None
    changes: tuple[Change, ...] = ()
    resumes: list[dict] = field(default_factory=list)
    base: dict | None = None  # where its frozen parameters come from (checkpointing.base_record)


def starting_point(
    trainer: BaseTrainer,
    checkpointer: Checkpointer,
    out_dir: Path,
    mode: RunMode,
    log: Callable[[str], None] = print,
) -> StartingPoint:
    """A fresh state, or the newest good checkpoint's state and data position (after the checks
    that the resumed run can continue with the same numbers), or with ``mode.init_from`` a fresh
    state holding another run's newest good parameters (other shapes: an error naming them)."""
    if mode.init_from is not None:
        storage = trainer.layouts.storage
        restored = read_base_params(trainer, mode.init_from, storage, log=log)
        fresh = trainer.init_state()  # fresh optimizer state and adapters
        params = _overlay(fresh.params, restored.state)
        base = base_record(trainer, params, run_dir=mode.init_from, step=restored.step)
        origin = f"parameters from {mode.init_from} (step {restored.step})"
        state = fresh.replace(params=params)
        return StartingPoint(state, first_step=1, data_position=0, resumed_from=origin, base=base)
    if not mode.resume:
        state = trainer.init_state()
        base = base_record(trainer, state.params, run_dir=None, step=None)
        return StartingPoint(state, first_step=1, data_position=0, base=base)
    restored = checkpointer.restore(None, lambda meta: restore_target(trainer, meta))
    state = restored.state
    if restored.meta.base is not None:  # the checkpoint holds the trained parameters alone
        frozen = frozen_params(trainer, restored.meta.base, trainer.layouts.storage, log=log)
        state = state.replace(params=trainer.partition.join(state.params, frozen))
    meta = restored.meta
    changes = resume_changes(meta, trainer.config, trainer.execution_facts())
    check_resume(changes, f"{out_dir} from step {meta.step}", allow_changes=mode.allow_changes)
    return StartingPoint(
        state,
        first_step=meta.step + 1,
        data_position=meta.data_position,
        resumed_from=(
            f"resumed from step {meta.step} (saved under {meta.policy} on mesh "
            f"{meta.mesh_shape}), data position {meta.data_position}"
        ),
        changes=tuple(changes),
        resumes=resume_history(out_dir / "run.json", meta.step, changes),
        base=meta.base,
    )


def _overlay(params: dict, restored: dict) -> dict:
    """``params`` with every leaf that ``restored`` holds replaced by it (nested dicts)."""
    out = dict(params)
    for key, value in restored.items():
        out[key] = _overlay(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def train(
    trainer: BaseTrainer,
    out_dir: str | Path,
    *,
    mode: RunMode = NEW_RUN,
    log: Callable[[str], None] = print,
) -> RunSummary:
    """Train to ``training.steps``, writing run records, metrics and checkpoints to ``out_dir``.

    With ``mode.resume``, continue from the newest good checkpoint there: same data position,
    RNG and optimizer state, so the losses equal those of an uninterrupted run. Settings that
    would change those numbers are refused unless ``mode.allow_changes`` (see
    :mod:`theseus.training.run.resume`).
    Raises a :class:`~theseus.training.run.stops.RunInterrupted` when the run stops early on purpose.
    """
    out_dir = Path(out_dir)
    config = trainer.config
    batch_plan = trainer.batch_plan
    log = log if is_main_process() else _silent
    require_wandb(config.logging.wandb)  # before anything is written
    corpus = load_data(trainer)
    validation = validation_array(trainer, corpus)
    prepare_run_dir(out_dir, mode)
    tensorboard = None
    if config.logging.tensorboard and is_main_process():
        tensorboard = TensorBoardWriter(out_dir, config.model_dump(mode="json"))
    checkpointer = Checkpointer(
        out_dir / CHECKPOINTS,
        keep=config.checkpointing.keep,
        async_save=config.checkpointing.async_save,
        log=log,
    )
    with failed_saves_stop_the_run(), checkpointer:
        start = starting_point(trainer, checkpointer, out_dir, mode, log=log)
        log(describe_processes())  # the run's first line
        for change in start.changes:
            log(f"resuming with a changed setting: {change.describe()}")
        if start.resumed_from is not None:
            log(start.resumed_from)
        log(batch_plan.describe())
        log(one_line_plan(trainer))
        log(
            f"model: {trainer.num_params:,} parameters ({_num_trained(trainer):,} trained); "
            f"policy {trainer.policy.describe()}; "
            f"mesh {trainer.topology.mesh_shape}; data {corpus.description}"
        )
        compile_start = time.perf_counter()
        compiled = trainer.compile()  # once, ahead of time: the loop calls its executable
        compile_time_s = time.perf_counter() - compile_start
        speed = speedometer(trainer, count_flops(trainer))
        write_run_record(
            trainer,
            out_dir,
            corpus=corpus,
            state=start.state,
            compiled=compiled,
            resumes=start.resumes,
            speed={"compile_time_s": compile_time_s, **speed.facts()},
        )
        initial_val_loss, _ = validation.losses(trainer, start.state.params)
        guard = NonFiniteGuard(
            config.training.nonfinite,
            config.training.max_skipped_steps,
            lambda: _next_move(checkpointer),
        )
        wandb = open_wandb(config, out_dir, resume=mode.resume)
        trackers = [t for t in (tensorboard, wandb) if t is not None]
        metrics = MetricsWriter(
            out_dir / "metrics.jsonl",
            trainer,
            speed,
            first_step=start.first_step,
            log=log,
            trackers=trackers,
            check_row=guard.check,
        )
        began = time.perf_counter()
        with contextlib.ExitStack() as closing, metrics:  # trackers close after the last row
            for tracker in trackers:
                closing.enter_context(tracker)
            preemption = closing.enter_context(PreemptionWatch(checkpointer.reached_preemption))
            _steps(
                trainer,
                step_fn=compiled.executable,
                start=start,
                sampler=corpus.sampler(batch_plan.seq_len, config.training.seed),
                validation=validation,
                checkpointer=checkpointer,
                metrics=metrics,
                preemption=preemption,
            )
        seconds = time.perf_counter() - began
        checkpointer.wait()
    losses, val_losses = metrics.history.losses, metrics.history.val_losses
    return RunSummary(
        out_dir=str(out_dir),
        first_step=start.first_step,
        steps=config.training.steps,
        first_loss=losses[0] if losses else float("nan"),
        final_loss=losses[-1] if losses else float("nan"),
        initial_val_loss=float(initial_val_loss),
        final_val_loss=val_losses[-1] if val_losses else None,
        seconds=seconds,
    )


def _steps(
    trainer: BaseTrainer,
    *,
    step_fn: Callable[[TrainState, jax.Array], tuple[TrainState, dict]],
    start: StartingPoint,
    sampler: MixtureSampler,
    validation: Validation,
    checkpointer: Checkpointer,
    metrics: MetricsWriter,
    preemption: PreemptionWatch,
) -> None:
    """The hot loop: dispatch step n, record step n - 1 (already computed), then make step
    n + 1's batch while step n runs.

    Validation and saves run with the metrics' clock paused, after step n - 1 is recorded, and
    the next batch is ready before the clock restarts, so each row times its own step. At a
    checkpoint step, step n's own metrics are read before its save (which waits for step n
    anyway), so a state after a non-finite step is never saved. On a preemption notice the step
    that all processes agreed on is saved, and the run stops.
    """
    training = trainer.config.training
    state, position = start.state, start.data_position
    batch = train_batch(trainer, sampler, position)
    for step in range(start.first_step, training.steps + 1):
        state, step_metrics = step_fn(state, batch)
        metrics.push(step, step_metrics)
        position += trainer.batch_plan.global_batch_size
        last = step == training.steps
        if not last:
            batch = train_batch(trainer, sampler, position)  # the next step's, while this runs
        if step % training.validation_interval == 0 or last:
            with metrics.paused():
                metrics.add_validation(*validation.losses(trainer, state.params))
        preempted = preemption.reached(step)
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


def evaluate(
    trainer: BaseTrainer,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> EvalResult:
    """Validation loss of the newest good checkpoint in ``source_dir`` (default: ``out_dir``),
    restored into this trainer's layouts; written to ``out_dir/eval.json``."""
    out_dir = Path(out_dir)
    log = log if is_main_process() else _silent
    source = Path(source_dir) if source_dir is not None else out_dir
    if not (source / CHECKPOINTS).is_dir():
        raise ValueError(
            f"nothing to evaluate: {source} holds no {CHECKPOINTS}/ folder; train first or give "
            "the run directory of a training job"
        )
    check_same_model(trainer.config, source)
    corpus = load_data(trainer)
    validation = validation_array(trainer, corpus)
    # Read-only: a training job may still be saving there.
    with Checkpointer(source / CHECKPOINTS, read_only=True, log=log) as checkpointer:
        restored = restore_params(trainer, checkpointer, trainer.layouts.storage, log=log)
    val_loss, by_source = validation.losses(trainer, restored.state)
    by_source = None if by_source is None else {k: float(v) for k, v in by_source.items()}
    result = EvalResult(str(out_dir), str(source), restored.step, float(val_loss), by_source)
    if is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eval.json").write_text(
            json.dumps({**asdict(result), "policy": trainer.policy.model_dump()}, indent=2) + "\n"
        )
    log(result.describe())
    return result
