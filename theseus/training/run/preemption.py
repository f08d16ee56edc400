"""Preemption: SIGTERM (what SLURM, Kubernetes and cloud schedulers send before killing) makes
the run finish its current step, save a checkpoint and stop.

In a multi-process run every process must stop at the same step, since saving is collective.
JAX's distributed runtime has that protocol: its preemption notifier catches SIGTERM on any
process and agrees on a step with the others, and
``jax.experimental.multihost_utils.reached_preemption_sync_point`` (which orbax's
``CheckpointManager.reached_preemption`` wraps) turns true at that step on all of them. It exists
only when ``jax.distributed`` is initialized; a single process instead keeps a flag set by a
SIGTERM handler; after the first SIGTERM the default action is back, so a second one ends the
process at once (JAX's notifier ignores further ones). A save cut short that way is never
committed (ignored, removed on the next start) and the previous checkpoints stay intact.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax


class PreemptionWatch:
    """``reached(step)``: stop after this step? Every process calls it at every step.

    A context manager: the SIGTERM handler (one process only) lives while the run does.
    ``reached_sync_point`` is the multi-process test (orbax's ``reached_preemption``).
    """

    def __init__(self, reached_sync_point: Callable[[int], bool]):
        self._reached_sync_point = reached_sync_point
        self._flag = threading.Event()
        self._previous: signal.Handlers | Callable[[int, FrameType | None], Any] | int | None = None
        self._installed = False

    def __enter__(self) -> PreemptionWatch:
        # With several processes, JAX's notifier owns SIGTERM: a Python handler would replace it.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        del signum, frame
        self._flag.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            return self._reached_sync_point(step)
        return self._flag.is_set()
