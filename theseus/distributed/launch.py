"""``theseus launch``: start P processes of one theseus command on this machine.

For trying a multi-process run on one machine, and for tests; on a cluster the scheduler
(``srun``, ``mpirun``, a Kubernetes job) starts the processes and ``--distributed auto`` joins
them. Each process joins through a free loopback port; its output lines are prefixed with its
index. When one process exits non-zero, the others are stopped (SIGTERM, then SIGKILL after a
grace period) and the launcher exits with the failing process's status and its last lines.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

LAUNCHABLE = ("train", "run", "import-hf", "evaluate")
# Flags the launcher sets itself; a command that gives them contradicts it.
LAUNCHER_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--distributed")
NUM_TAIL_LINES = 20
POLL_S = 0.1


@dataclass
class Worker:
    """One launched process, its output reader and its last lines."""

    index: int
    process: subprocess.Popen
    tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=NUM_TAIL_LINES)
    )
    reader: threading.Thread | None = None


def free_port() -> int:
    """A TCP port on loopback that no one listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_command(command: list[str], cpu_devices_per_process: int | None) -> None:
    """ValueError when ``command`` is not something the launcher can start P times."""
    if not command or command[0] not in LAUNCHABLE:
        raise ValueError(
            f"theseus launch starts one of the commands {LAUNCHABLE} in each process, got "
            f"{' '.join(command) or 'nothing'}; e.g. theseus launch -n 2 -- train --out runs/mp"
        )
    given = [flag for flag in LAUNCHER_FLAGS if any(a.split("=")[0] == flag for a in command)]
    if cpu_devices_per_process is not None and any(
        a.split("=")[0] == "--cpu-devices" for a in command
    ):
        given.append("--cpu-devices")
    if given:
        raise ValueError(
            f"theseus launch sets {', '.join(given)} for each process itself; drop them from the "
            "command (use -n and --cpu-devices-per-process)"
        )


def process_argv(
    command: list[str], index: int, num_processes: int, port: int, cpu_devices: int | None
) -> list[str]:
    """The command line of process ``index``."""
    argv = [sys.executable, "-m", "theseus", *command]
    argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes)]
    argv += ["--process-id", str(index)]
    if cpu_devices is not None:
        argv += ["--cpu-devices", str(cpu_devices)]
    return argv


def launch(
    command: list[str],
    num_processes: int,
    cpu_devices_per_process: int | None = None,
    *,
    grace_s: float = 5.0,
    out: TextIO | None = None,
) -> int:
    """Run ``theseus COMMAND`` as ``num_processes`` joined processes; return the job's status.

    The status is 0 when all succeed, else the first failing process's exit status (128 + N for
    a process ended by signal N).
    """
    check_command(command, cpu_devices_per_process)
    if num_processes < 1:
        raise ValueError(f"-n must be at least 1, got {num_processes}")
    out = out or sys.stdout
    lock = threading.Lock()
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    workers = []
    for index in range(num_processes):
        process = subprocess.Popen(
            process_argv(command, index, num_processes, port, cpu_devices_per_process),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped as a whole
        )
        worker = Worker(index, process)
        worker.reader = threading.Thread(target=_relay, args=(worker, out, lock), daemon=True)
        worker.reader.start()
        workers.append(worker)
    try:
        failed = _wait_for_failure(workers)
    except KeyboardInterrupt:
        _stop(workers, grace_s)
        return 128 + signal.SIGINT
    if failed is not None:
        _stop(workers, grace_s)
    for worker in workers:
        if worker.reader is not None:
            worker.reader.join(timeout=grace_s)
    if failed is None:
        return 0
    status = _exit_status(failed.process.returncode)
    lines = "\n".join(f"  {line}" for line in failed.tail)
    print(
        f"launch: process {failed.index} exited with status {status}; the others were stopped. "
        f"Its last lines:\n{lines}",
        file=sys.stderr,
    )
    return status


def _relay(worker: Worker, out: TextIO, lock: threading.Lock) -> None:
    """Copy a process's output to ``out``, each line prefixed with its index."""
    assert worker.process.stdout is not None  # started with stdout=PIPE
    for raw in worker.process.stdout:
        line = raw.decode(errors="replace").rstrip("\n")
        worker.tail.append(line)
        with lock:
            out.write(f"[{worker.index}] {line}\n")
            out.flush()


def _wait_for_failure(workers: list[Worker]) -> Worker | None:
    """Block until all processes succeed (None) or one fails (that one)."""
    while True:
        codes = [w.process.poll() for w in workers]
        for worker, code in zip(workers, codes, strict=True):
            if code is not None and code != 0:
                return worker
        if all(code == 0 for code in codes):
            return None
        time.sleep(POLL_S)


def _stop(workers: list[Worker], grace_s: float) -> None:
    """SIGTERM every running process group, then SIGKILL what is left after ``grace_s``."""
    running = [w for w in workers if w.process.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for worker in running:
            with contextlib.suppress(ProcessLookupError):  # it has exited meanwhile
                os.killpg(worker.process.pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(w.process.poll() is None for w in running):
            time.sleep(POLL_S)
        running = [w for w in running if w.process.poll() is None]
        if not running:
            return
    for worker in running:
        worker.process.wait()


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
