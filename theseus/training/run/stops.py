"""Ways a run ends early on purpose, each with the exit status of ``theseus train``.

They are not usage errors (status 2): the command was right, and the run stopped to lose nothing.
(A checkpoint that cannot be written stops a run too:
:class:`theseus.checkpoint.checkpointer.CheckpointWriteError`, status 5.)
The message says what happened, at which step, and which checkpoint a ``--resume`` continues from.

Non-finite steps: the step drops their update on device (:mod:`theseus.training.nonfinite`); the
host sees the ``skipped`` flag on its one-step-late read of the metrics (no extra sync) and, per
``training.nonfinite``, stops the run (``stop``) or goes on (``skip``) until
``training.max_skipped_steps`` steps in a row were skipped (:class:`NonFiniteGuard`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

from theseus.training.nonfinite import WATCHED


class RunInterrupted(Exception):
    """A run that stopped before its last step; ``exit_code`` is the command's exit status."""

    exit_code: ClassVar[int] = 1


class NonFiniteError(RunInterrupted):
    """A step's loss or gradient norm was not finite (``training.nonfinite``)."""

    exit_code: ClassVar[int] = 3


class Preempted(RunInterrupted):
    """SIGTERM: the current step finished, a checkpoint was saved; ``--resume`` continues."""

    exit_code: ClassVar[int] = 4


class NonFiniteGuard:
    """The host's side of ``training.nonfinite``: fed every metrics row in step order."""

    def __init__(self, mode: str, max_skipped_steps: int, advice: Callable[[], str]):
        self.mode = mode
        self.max_skipped_steps = max_skipped_steps
        self.advice = advice  # () -> what to do next: the newest good checkpoint, if any
        self.skipped_in_a_row = 0

    def check(self, row: dict) -> None:
        """Raise :class:`NonFiniteError` when the run must stop after ``row``'s step."""
        if not row.get("skipped"):
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        bad = ", ".join(
            f"{name} is {row[name]}" for name in WATCHED if not math.isfinite(row[name])
        )
        if self.mode == "skip" and self.skipped_in_a_row < self.max_skipped_steps:
            return
        why = (
            f"training.max_skipped_steps={self.max_skipped_steps} steps in a row were skipped"
            if self.mode == "skip"
            else "training.nonfinite=stop; training.nonfinite=skip would skip such steps"
        )
        raise NonFiniteError(
            f"step {row['step']}: {bad}; its update was not applied and no state after it was "
            f"saved ({why}). {self.advice()}"
        )
