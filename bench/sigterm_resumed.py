"""SIGTERM to one process of a resumed two-process run, repeated: every process must stop at one
step and save it, whichever process gets the signal and whenever it comes.

A base run of two joined processes (2 × 4 simulated CPU devices, tp=2 + FSDP) is preempted by
SIGTERM once. Each trial resumes a copy of it and sends SIGTERM to ``--process`` (0, 1, or
both in turn) at a moment that varies from trial to trial: as soon as process 0 says it resumed
(before the first step: restore done, compile and the first validation under way), or once the
resumed run recorded its 1st, 2nd, 3rd ... step. A trial passes when both processes exit with
status 4 ("stopped: preempted"), name the same step, and that step is the newest committed
checkpoint; it fails when a process ran to the end (the signal ignored) or hung (timeout).
Exit status 0: every trial passed.

    PYTHONPATH=. python bench/sigterm_resumed.py --trials 20 --process 0
    PYTHONPATH=. python bench/sigterm_resumed.py --trials 20 --process 1
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--trials", type=int, default=20)
parser.add_argument("--process", choices=("0", "1", "both"), default="both")
parser.add_argument("--steps", type=int, default=400, help="training.steps of the run")
parser.add_argument("--timeout", type=float, default=240, help="seconds a trial may take")
parser.add_argument("--keep", type=Path, help="keep the runs in this folder")
args = parser.parse_args()

MODEL = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=4",
    "model.block_size=16",
    "training.batch_size=16",
    "training.per_device_batch_size=2",
    "training.validation_interval=50",
    "training.validation_batches=1",
    "checkpointing.interval=50",
    "logging.progress_bar=false",
]
ARGS = ["--tp", "2", "--fsdp", "--cpu-devices", "4", *MODEL, f"training.steps={args.steps}"]
# Where the resumed run gets the signal: after process 0 said it resumed, or after its k-th step.
MOMENTS = ["resumed", 1, 2, 3, 5, 8]
STOPPED = re.compile(r"stopped: preempted \(SIGTERM\): finished step (\d+) of")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(out: Path, *extra: str) -> list[subprocess.Popen]:
    """Two joined processes of ``theseus train`` (each a supervisor and its worker)."""
    port = free_port()
    cache = str(out.parent / "compilation-cache")  # the trials compile once
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": cache}
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    command = [sys.executable, "-m", "theseus", "train", "--out", str(out), *ARGS, *extra]
    joined = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    return [
        subprocess.Popen(
            [*command, *joined, str(index)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for index in range(2)
    ]


def recorded_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count('"step"') if path.is_file() else 0


def wait_for(condition, processes: list[subprocess.Popen], deadline: float) -> bool:
    """Poll ``condition`` until true (True) or a process ended or time ran out (False)."""
    while not condition():
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def finish(processes: list[subprocess.Popen], deadline: float) -> list[tuple[int, str, str]]:
    """Exit statuses and outputs; a process still running at ``deadline`` is killed (-9)."""
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        results.append((process.returncode, stdout, stderr))
    return results


def stops(results: list[tuple[int, str, str]]) -> list[int | None]:
    found = [STOPPED.search(stderr) for _, _, stderr in results]
    return [int(m.group(1)) if m else None for m in found]


def newest_checkpoint(out: Path) -> int | None:
    steps = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    return max(steps, default=None)


def base_run(folder: Path) -> tuple[Path, int]:
    """A two-process run preempted (SIGTERM to process 1) after its 3rd step."""
    out = folder / "base"
    processes = start(out)
    deadline = time.monotonic() + args.timeout
    if wait_for(lambda: recorded_steps(out) >= 3, processes, deadline):
        processes[1].send_signal(signal.SIGTERM)
    results = finish(processes, deadline)
    stopped = stops(results)
    if [r[0] for r in results] != [4, 4] or len(set(stopped)) != 1:
        sys.exit(f"the base run did not stop on SIGTERM: {results}")
    return out, stopped[0]


def trial(base: Path, folder: Path, index: int, target: int) -> tuple[bool, str]:
    """Resume a copy of ``base``, SIGTERM process ``target`` at this trial's moment."""
    out = folder / f"trial-{index:02d}-p{target}"
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("logs"))
    resumed_from = newest_checkpoint(out)
    moment = MOMENTS[index % len(MOMENTS)]
    before = recorded_steps(out)
    processes = start(out, "--resume")
    deadline = time.monotonic() + args.timeout
    if moment == "resumed":
        # Process 0 logs "resumed from step N" once its restore is done, before compiling.
        lines: list[str] = []

        def said_resumed() -> bool:
            lines.append(processes[0].stdout.readline())
            return lines[-1].startswith("resumed from step") or lines[-1] == ""

        ready = wait_for(said_resumed, processes, deadline) and lines[-1] != ""
    else:
        ready = wait_for(lambda: recorded_steps(out) >= before + moment, processes, deadline)
    sent_at = recorded_steps(out) - before
    if ready:
        processes[target].send_signal(signal.SIGTERM)  # to its supervisor, which passes it on
    results = finish(processes, deadline)
    statuses, stopped = [r[0] for r in results], stops(results)
    newest = newest_checkpoint(out)
    what = (
        f"trial {index:2d}: SIGTERM to process {target} at {moment!r} (after {sent_at} new "
        f"rows; resumed from {resumed_from}): statuses {statuses}, stopped at {stopped}, "
        f"newest checkpoint {newest}"
    )
    passed = (
        ready
        and statuses == [4, 4]
        and stopped[0] is not None
        and stopped[0] == stopped[1] == newest
        and resumed_from < newest < args.steps
    )
    if not passed:
        what += "\n" + "\n".join(f"  process {i}: {r[2][-1500:]}" for i, r in enumerate(results))
    if passed and args.keep is None:
        shutil.rmtree(out)
    return passed, what


def main() -> int:
    folder = args.keep or Path(tempfile.mkdtemp(prefix="sigterm-resumed-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        began = time.monotonic()
        base, stopped = base_run(folder)
        print(f"base run: stopped at step {stopped} ({time.monotonic() - began:.0f} s)", flush=True)
        targets = [0, 1] if args.process == "both" else [int(args.process)]
        failures = 0
        for target in targets:
            for index in range(args.trials):
                began = time.monotonic()
                passed, what = trial(base, folder, index, target)
                failures += not passed
                verdict = "pass" if passed else "FAIL"
                print(f"{verdict} {what} ({time.monotonic() - began:.0f} s)", flush=True)
        total = args.trials * len(targets)
        print(f"{total - failures} of {total} trials passed")
        return 1 if failures else 0
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
