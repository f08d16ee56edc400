"""Ways a run ends early on purpose, each with the exit status of ``theseus train``.

They are not usage errors (status 2): the command was right, and the run stopped to lose nothing.
The message says what happened, at which step, and which checkpoint a ``--resume`` continues from.
"""

from __future__ import annotations

from typing import ClassVar


class RunInterrupted(Exception):
    """A run that stopped before its last step; ``exit_code`` is the command's exit status."""

    exit_code: ClassVar[int] = 1


class NonFiniteError(RunInterrupted):
    """A step's loss or gradient norm was not finite (``training.nonfinite``)."""

    exit_code: ClassVar[int] = 3


class Preempted(RunInterrupted):
    """SIGTERM: the current step finished, a checkpoint was saved; ``--resume`` continues."""

    exit_code: ClassVar[int] = 4


class CheckpointSaveError(RunInterrupted):
    """A checkpoint could not be written; the previously committed ones are intact."""

    exit_code: ClassVar[int] = 5
