"""The metrics of a run: one JSON row per step in ``metrics.jsonl``, shown by the reporter, read
from the device one step late so the host never waits on it inside the loop; validation and
checkpoint saves are kept out of every step's time (:meth:`MetricsWriter.paused`)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import jax

from theseus.distributed.join import is_main_process
from theseus.training.run.data import Validated
from theseus.training.run.progress import Reporter
from theseus.training.run.throughput import Speedometer, StepClock
from theseus.training.trainer import BaseTrainer


@dataclass(frozen=True)
class PendingStep:
    """A dispatched step whose metrics are still on the device."""

    step: int
    metrics: dict[str, jax.Array]
    host: dict[str, float] = field(default_factory=dict)  # measured making the step's batch


class Tracker(Protocol):
    """Where recorded rows go besides ``metrics.jsonl`` (TensorBoard, Weights & Biases)."""

    def write(self, row: dict[str, Any]) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc_info: object) -> None: ...


@dataclass
class MetricsHistory:
    """The losses recorded so far (main process only writes them to disk)."""

    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # an RL run's
    val_rewards: list[float] = field(default_factory=list)


class MetricsWriter:
    """Owns ``metrics.jsonl`` (written by the main process), the progress reporter and the
    one-step-late read: :meth:`push` hands in step n's device metrics and records step n - 1's,
    which the device has finished by then; leaving the ``with`` block records the last one.
    Work between steps (validation, a save) runs inside :meth:`paused`.

    The run's length and logging settings come from ``trainer``'s config, the tokens per step
    and the rates from ``speed``. A run that starts at ``first_step`` (after a resume) keeps the
    rows of the earlier segment up to ``first_step - 1`` and drops the rest; a new run starts at
    step 1 and keeps none.
    """

    def __init__(
        self,
        path: Path,
        trainer: BaseTrainer,
        speed: Speedometer,
        *,
        first_step: int,
        trackers: Sequence[Tracker] = (),
        check_row: Callable[[dict], None] = lambda row: None,
    ):
        self.path = path
        self.first_step = first_step
        self.speed = speed  # step time → tokens/s and MFU
        self.trackers = trackers  # TensorBoard, W&B: when asked for
        self.check_row = check_row  # e.g. stop after a non-finite step
        self._clock = StepClock()
        self.history = MetricsHistory()
        config = trainer.config
        self._reporter = Reporter(first_step - 1, config.training.steps, config.logging)
        self._file: IO[str] | None = None
        self._pending: PendingStep | None = None
        self._pending_row: dict[str, Any] | None = None  # the held step's row, once read

    def __enter__(self) -> MetricsWriter:
        if is_main_process():
            kept = kept_rows(self.path, self.first_step - 1)
            self.path.write_text("".join(row + "\n" for row in kept))
            self._file = open(self.path, "a")  # closed in __exit__
        self._reporter.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if exc_info[0] is None:
                self.flush()
        finally:
            self._reporter.__exit__(*exc_info)
            if self._file is not None:
                self._file.close()

    def push(
        self, step: int, metrics: dict[str, jax.Array], host: dict[str, float] | None = None
    ) -> None:
        """Hold step ``step``'s metrics (and what the host measured making its batch, ``host``);
        record the step before it. A step that has already finished (XLA:CPU runs small
        programs inline, at dispatch) is read and timed now."""
        self.flush()
        self._pending = PendingStep(step, metrics, dict(host or {}))
        if all(leaf.is_ready() for leaf in jax.tree.leaves(metrics)):  # no wait
            self._held_row()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work between two steps (validation, a checkpoint save): the held step is read (and
        timed) before it, and the clock restarts after it, so no step's time holds it."""
        self._held_row()
        try:
            yield
        finally:
            self._clock.restart()

    def add_validation(self, validated: Validated) -> None:
        """Put the held step's validation loss (where the data has one) in its row, each
        source's, and the other validation metrics prefixed ``val_`` as ``val_loss`` is (waits
        for them: call it inside :meth:`paused`)."""
        row = self._held_row()
        if validated.loss is not None:
            row["val_loss"] = float(validated.loss)
        means = jax.device_get(validated.means)
        row |= {f"val_{name}": float(value) for name, value in means.items()}
        if validated.by_source is not None:
            by_source = jax.device_get(validated.by_source)
            row["val_loss_by_source"] = {name: float(v) for name, v in by_source.items()}

    def add_scores(self, scores: dict[str, float] | None) -> None:
        """Put the held step's task scores (``task/metric``: value) in its row as ``tasks``."""
        if scores is not None:
            self._held_row()["tasks"] = dict(scores)

    def _held_row(self) -> dict[str, Any]:
        """The held step's row, read from the device the first time it is asked for."""
        assert self._pending is not None, "no step is held"
        if self._pending_row is None:
            self._pending_row = self.row(self._pending)
        return self._pending_row

    def row(self, pending: PendingStep) -> dict[str, Any]:
        """The row of a step (reads its metrics from the device): numbers as floats, flags as
        booleans, a vector (an MoE model's ``expert_load``) as a dict by index."""
        metrics = jax.device_get(pending.metrics)
        row: dict[str, Any] = {"step": pending.step}
        row |= {k: _value(v) for k, v in metrics.items()}
        row |= pending.host
        row["trained_tokens"] = int(row["trained_tokens"])  # targets that trained (masked: fewer)
        # device_get returned when the step finished
        row |= self.speed.rates(self._clock.lap(), row["trained_tokens"])
        row["tokens"] = pending.step * self.speed.tokens_per_step
        return row

    def flush(self) -> None:
        """Record the held step now (before a checkpoint of it is saved, say)."""
        if self._pending is None:
            return
        row = self._held_row()
        self._pending = self._pending_row = None
        self.history.losses.append(row["loss"])
        if "val_loss" in row:
            self.history.val_losses.append(row["val_loss"])
        if "reward" in row:
            self.history.rewards.append(row["reward"])
        if "val_reward" in row:
            self.history.val_rewards.append(row["val_reward"])
        if self._file is not None:
            self._file.write(json.dumps(strict_json_row(row), allow_nan=False) + "\n")
            self._file.flush()
        for tracker in self.trackers:
            tracker.write(row)
        self._reporter.update(row)
        self.check_row(row)


def _value(v: Any) -> Any:
    if v.ndim == 1:
        return {str(i): float(x) for i, x in enumerate(v)}
    return bool(v) if v.dtype == bool else float(v)


def kept_rows(path: Path, last_step: float) -> list[str]:
    """Rows of an earlier run segment up to ``last_step``: the ones a resumed run keeps."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                rows.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a row cut by a crash ends what can be trusted
    return rows


def strict_json_row(row: dict) -> dict:
    """``row`` with non-finite floats as ``None`` (JSON ``null``): strict JSON readers such as
    ``jq`` reject the bare ``NaN`` and ``Infinity`` that Python's json writes."""
    return {
        key: strict_json_row(value)
        if isinstance(value, dict)
        else None
        if isinstance(value, float) and not math.isfinite(value)
        else value
        for key, value in row.items()
    }
