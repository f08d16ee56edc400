"""A thin parent for each process of a multi-process job, so that a dead peer ends it cleanly.

When a peer dies, JAX's distributed runtime ends every other process from C++ (an abort with a
stack trace, after the heartbeat timeout); Python cannot catch that. So each process of a
multi-process ``theseus train`` or ``theseus run`` is a worker child of this parent (which never
imports JAX). The worker's file descriptor 2, where JAX's C++ logs and abort traces go, is the
log file ``RUN_DIR/logs/process-N.log``, and so is fd 1 (gloo's messages); its Python
``sys.stdout`` and ``sys.stderr`` (progress, error paragraphs, tracebacks) stay on the terminal.
When the worker dies of a signal, the parent prints one paragraph: which process stopped
responding, the newest committed checkpoint, and the command that resumes.

A dead peer often reaches a survivor first as a Python exception (a collective fails with
"Connection reset by peer") rather than as the runtime's abort; which comes first is a race. So a
worker's uncaught ``jax.errors.JaxRuntimeError`` goes, with its traceback, to the log, and the
worker waits for the runtime's verdict: when a peer is gone, the runtime aborts the worker
within the heartbeat timeout and the parent prints the same paragraph as above. When no abort
comes in ``heartbeat timeout + RUNTIME_VERDICT_GRACE_S`` seconds, no peer is lost: the error is
shown on the terminal as any other (later by that wait), and the worker exits with status 1.
Other exceptions (bugs, user errors) are shown at once, as in a single process.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TextIO

from theseus.config import CHECKPOINTS

# Set in a worker's environment: the file descriptors of the terminal's stdout and stderr.
WORKER_ENV = "THESEUS_WORKER_TERMINAL_FDS"
EXIT_PEER_LOST = 1
#: The commands that save checkpoints and continue with --resume.
TRAINING_COMMANDS = ("train", "run")
_TAIL_BYTES = 64 * 1024
# Seconds past the heartbeat timeout for JAX's runtime to notice a lost peer and end the worker.
RUNTIME_VERDICT_GRACE_S = 15


def is_worker() -> bool:
    return WORKER_ENV in os.environ


def set_up_worker(heartbeat_timeout_s: int) -> None:
    """In a worker: Python's stdout and stderr go to the terminal; fds 1 and 2 (native code:
    JAX's C++ logs, gloo's messages, abort traces) stay on the log file. A JAX runtime error
    waits there for the runtime's verdict on the peers (see the module's docstring)."""
    fds = os.environ.pop(WORKER_ENV, None)
    if fds is None:
        return
    log = os.fdopen(os.dup(2), "w", buffering=1)
    # Libraries' Python log records (orbax's background errors when a peer is gone) join the
    # native detail in the log file; the terminal gets theseus's own messages.
    logging.basicConfig(stream=log, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out_fd, err_fd = map(int, fds.split(","))
    sys.stdout = os.fdopen(out_fd, "w", buffering=1)
    sys.stderr = os.fdopen(err_fd, "w", buffering=1)
    previous = sys.excepthook  # typer's, which shows the traceback

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        wait_s = heartbeat_timeout_s + RUNTIME_VERDICT_GRACE_S
        report_uncaught(kind, error, tb, log=log, wait_s=wait_s, show=previous)

    sys.excepthook = hook


def is_runtime_error(error: BaseException) -> bool:
    """Whether ``error`` came from JAX's runtime (a failed collective, among others)."""
    if "jax" not in sys.modules:
        return False  # JAX never ran here: not its error
    from jax.errors import JaxRuntimeError

    return isinstance(error, JaxRuntimeError)


def report_uncaught(
    kind: type[BaseException],
    error: BaseException,
    tb: TracebackType | None,
    *,
    log: TextIO,
    wait_s: float,
    show: Callable[[type[BaseException], BaseException, TracebackType | None], None],
) -> None:
    """A worker's uncaught exception: a JAX runtime error goes to ``log`` and waits ``wait_s``
    seconds for the runtime to end the process (a lost peer); then, or at once for any other
    error, ``show`` puts it on the terminal."""
    if is_runtime_error(error):
        traceback.print_exception(kind, error, tb, file=log)
        print(f"theseus: waiting up to {wait_s} s for JAX's runtime to report lost peers", file=log)
        log.flush()
        time.sleep(wait_s)
    show(kind, error, tb)


def log_path(run_dir: Path, process_id: int) -> Path:
    return run_dir / "logs" / f"process-{process_id}.log"


def supervise(argv: list[str], run_dir: Path, process_id: int) -> int:
    """Run ``theseus ARGV`` as a worker; return the exit status this process should end with.

    SIGTERM sent to the parent is passed on to the worker (which decides how to stop).
    """
    path = log_path(run_dir, process_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    terminal = (os.dup(1), os.dup(2))
    with open(path, "ab") as log:
        log.write(
            f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} theseus {shlex.join(argv)}\n".encode()
        )
        log.flush()
        worker = subprocess.Popen(
            [sys.executable, "-m", "theseus", *argv],
            stdout=log,
            stderr=log,
            pass_fds=terminal,
            env={**os.environ, WORKER_ENV: ",".join(map(str, terminal))},
        )
    for fd in terminal:
        os.close(fd)
    # Ctrl-C reaches the worker from the terminal (same process group); SIGTERM is passed on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, _frame: worker.send_signal(signum))
    status = worker.wait()
    if status >= 0:
        return status  # the worker ended on its own and said why
    print(
        "error: " + stopped_paragraph(argv, run_dir, process_id, -status, read_tail(path)),
        file=sys.stderr,
    )
    return EXIT_PEER_LOST


def read_tail(path: Path) -> str:
    with open(path, "rb") as file:
        file.seek(max(0, path.stat().st_size - _TAIL_BYTES))
        return file.read().decode(errors="replace")


def lost_processes(log_tail: str) -> list[int] | None:
    """The peers JAX's runtime reported dead in a worker's log, or None when it reported none."""
    match = re.search(r"stopped sending heartbeats\):\s*\n((?:\s*\d+\s*\n)+)", log_tail)
    if match:
        return sorted({int(n) for n in match.group(1).split()})
    if "leader task was preempted/died" in log_tail:
        return [0]  # the coordinator (process 0) is gone
    return None


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest committed step directory under the run (orbax commits by renaming a temporary
    directory to the bare step number)."""
    steps = [
        path
        for folder in (run_dir / CHECKPOINTS, *run_dir.glob(f"*/{CHECKPOINTS}"))
        if folder.is_dir()
        for path in folder.iterdir()
        if path.name.isdigit() and path.is_dir()
    ]
    # A chain's step folders (00-..., 01-...) sort in the order they run.
    return max(steps, key=lambda p: (str(p.parent), int(p.name)), default=None)


def restart_command(argv: list[str], *, resume: bool) -> str:
    """The same command, continuing from the newest checkpoint (or replacing the run)."""
    flag, other = ("--resume", "--overwrite") if resume else ("--overwrite", "--resume")
    kept = [arg for arg in argv if arg != other]
    if flag not in kept:
        kept.append(flag)
    return "theseus " + shlex.join(kept)


def stopped_paragraph(
    argv: list[str], run_dir: Path, process_id: int, signum: int, log_tail: str
) -> str:
    """Why this process stopped, what survives, and how to continue, in one paragraph."""
    lost = lost_processes(log_tail)
    if lost is not None:
        who = ", ".join(map(str, lost))
        cause = (
            f"process {who} of this job stopped responding, so JAX's distributed runtime "
            f"ended this process ({process_id}) too"
        )
    elif "JAX distributed service detected fatal errors" in log_tail:
        cause = f"JAX's distributed runtime ended process {process_id}: a peer failed"
    else:
        cause = f"process {process_id} was ended by {signal.Signals(signum).name}"
    checkpoint = newest_checkpoint(run_dir)
    if argv[0] not in TRAINING_COMMANDS:  # it reads a run, or writes one whole: start it again
        saved, how, again = (
            "it does not continue from checkpoints",
            "start every process again",
            "theseus " + shlex.join(argv),
        )
    elif checkpoint is not None:
        saved = f"nothing committed is lost: the newest checkpoint is {checkpoint} (step {checkpoint.name})"
        how, again = "continue every process with --resume", restart_command(argv, resume=True)
    else:
        saved = "no checkpoint was committed yet"
        how, again = "start every process again", restart_command(argv, resume=False)
    return (
        f"{cause}; {saved}. When all processes can run, {how}, on this one: {again}. JAX's own "
        f"report is in {log_path(run_dir, process_id)}."
    )
