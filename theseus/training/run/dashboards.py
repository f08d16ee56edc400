"""Dashboards (TensorBoard, Weights & Biases) that fail after the run started never stop it.

``metrics.jsonl`` is the run's record; a dashboard is a copy. When a dashboard's write fails (a
network outage, a quota, a full disk under its folder), one line names the cause and the run goes
on; the rows it missed are held, in order, and each later row first retries them, so a dashboard
that comes back within the run catches up (one line says so) with its steps still increasing, as
W&B requires. Past :data:`MAX_HELD_ROWS` held rows the oldest are given up (said when it comes
back); rows still held when the run ends are said in one line, and the dashboard's ``missed``
callback is told the first of them: :func:`keep_missed` keeps it in the dashboard's record (W&B's
``wandb-run.json``, TensorBoard's ``tensorboard/missed.json``), and the next ``--resume`` writes the
rows it missed from ``metrics.jsonl`` first (:func:`missed_rows`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from theseus.distributed.join import main_process_logger
from theseus.training.run.metrics import Tracker, kept_rows

logger = main_process_logger(__name__)

#: Rows held for a failing dashboard (a few hundred bytes each).
MAX_HELD_ROWS = 10_000


def one_line(error: BaseException) -> str:
    """An exception as ``Type: first line of its message``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def steps_text(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


class GuardedDashboard:
    """Writes rows to ``tracker`` (named ``name`` in messages) without ever raising; a context
    manager that enters and closes ``tracker`` likewise. ``missed(step)`` is called at the end
    with the first step the dashboard never received, when there is one."""

    def __init__(
        self,
        tracker: Tracker,
        name: str,
        *,
        missed: Callable[[int], None] = lambda step: None,
    ):
        self.tracker = tracker
        self.name = name
        self.missed = missed
        self.held: list[dict[str, Any]] = []
        self.given_up: tuple[int, int] | None = None  # the steps dropped from ``held``

    def write(self, row: dict[str, Any]) -> None:
        was_failing = bool(self.held)
        self.held.append(row)
        try:
            while self.held:
                self.tracker.write(self.held[0])
                self.held.pop(0)
        except Exception as error:  # noqa: BLE001 - whatever the dashboard raises, training goes on
            if not was_failing:
                logger.warning(
                    f"{self.name} failed at step {row['step']} ({one_line(error)}); training "
                    f"goes on and every row is in metrics.jsonl; {self.name} gets the rows it "
                    "missed if it works again during the run"
                )
            self._give_up_oldest()
            return
        if was_failing:
            logger.info(self._back_message(row["step"]))

    def _give_up_oldest(self) -> None:
        if len(self.held) <= MAX_HELD_ROWS:
            return
        dropped = self.held.pop(0)["step"]
        first = self.given_up[0] if self.given_up else dropped
        self.given_up = (first, dropped)

    def _back_message(self, step: int) -> str:
        message = f"{self.name} works again at step {step}"
        if self.given_up is None:
            return message + ": it caught up on the rows it missed"
        first, last = self.given_up
        self.given_up = None
        return (
            f"{message}; it could not catch up on {steps_text(first, last)} (more than "
            f"{MAX_HELD_ROWS:,} rows were missed): they are in metrics.jsonl only"
        )

    def __enter__(self) -> GuardedDashboard:
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.tracker.__exit__(*exc_info)
        except Exception as error:  # noqa: BLE001 - closing a broken dashboard must not fail the run
            logger.warning(f"{self.name} could not be closed ({one_line(error)})")
        given_up = self.given_up
        if self.held or given_up:
            first = given_up[0] if given_up else self.held[0]["step"]
            last = given_up[1] if given_up and not self.held else self.held[-1]["step"]
            logger.warning(
                f"{self.name} did not get {steps_text(first, last)} (metrics.jsonl holds every row)"
            )
            self.missed(first)


def keep_missed(record: Path) -> Callable[[int], None]:
    """What to do with the first step a dashboard missed when the run ends: keep it in its
    ``record`` (a JSON object, ``missed_from``), for the next ``--resume``."""

    def keep(step: int) -> None:
        kept = json.loads(record.read_text()) if record.is_file() else {}
        record.write_text(json.dumps({**kept, "missed_from": step}) + "\n")

    return keep


def missed_rows(record: Path, metrics: Path, first_step: int) -> list[dict[str, Any]]:
    """The rows of ``metrics`` (``metrics.jsonl``) that a dashboard missed in an earlier segment
    (from its record's ``missed_from`` to ``first_step - 1``; later ones the resumed run writes
    as it trains them), forgotten from the record once read: a failure while writing them keeps
    them again."""
    kept = json.loads(record.read_text()) if record.is_file() else {}
    if "missed_from" not in kept:
        return []
    record.write_text(json.dumps({k: v for k, v in kept.items() if k != "missed_from"}) + "\n")
    rows = (json.loads(line) for line in kept_rows(metrics, first_step - 1))
    return [_as_logged(row) for row in rows if row["step"] >= kept["missed_from"]]


def _as_logged(row: dict[str, Any]) -> dict[str, Any]:
    """A row read back from ``metrics.jsonl``, whose non-finite numbers are ``null``, as the run
    logged it (NaN)."""
    return {
        key: _as_logged(value) if isinstance(value, dict) else math.nan if value is None else value
        for key, value in row.items()
    }
