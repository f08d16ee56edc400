"""Preemption: SIGTERM (what SLURM, Kubernetes and cloud schedulers send before killing) makes
the run finish its current step, save a checkpoint and stop.

In a multi-process run every process must stop at the same step, since saving is collective.
JAX's distributed runtime has that protocol: its preemption notifier catches SIGTERM on any
process, and ``jax.experimental.multihost_utils.reached_preemption_sync_point(n)`` turns true on
all of them at the same call. It exists only when ``jax.distributed`` is initialized; a single
process instead keeps a flag set by a SIGTERM handler; after the first SIGTERM the default action
is back, so a second one ends the process at once (JAX's notifier ignores further ones). A save
cut short that way is never committed (ignored, removed on the next start) and the previous
checkpoints stay intact.

JAX's protocol, on a notice: each process sends the last ``n`` it passed (0 before its first
call), and the sync point is the largest plus one. So ``n`` counts the loop's steps since this
process started, from 1, never the run's step: a notice that arrives before the first call (in
the restore, the compile or the first validation of a resumed run) sets the sync point at 1,
which a resumed run's steps (its first is the checkpoint's step + 1) would never equal, and the
run would ignore the signal to its end (``bench/sigterm_resumed.py`` repeats that case). Nothing
else may pass another ``n``: orbax's manager would pass the run's step from its save and from its
background commit, so theseus's store turns orbax's own look at the sync point off.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax


def _jax_sync_point(count: int) -> bool:
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(count)


class PreemptionWatch:
    """``reached()``: stop after the step just finished? Every process calls it once a step.

    A context manager: the SIGTERM handler (one process only) lives while the run does.
    ``sync_point`` is the multi-process test, given the count of calls so far (JAX's
    ``reached_preemption_sync_point`` by default).
    """

    def __init__(self, sync_point: Callable[[int], bool] = _jax_sync_point):
        self._sync_point = sync_point
        self._calls = 0
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

    def reached(self) -> bool:
        """Whether the run stops after the step just finished (the sync point is keyed by the
        count of calls, not by the run's step: see the module's docstring)."""
        self._calls += 1
        if jax.process_count() > 1:
            return self._sync_point(self._calls)
        return self._flag.is_set()
