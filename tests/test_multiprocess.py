"""Many processes on one machine, joined by JAX's distributed runtime on loopback: `theseus
launch`, a SLURM-style environment detected by JAX itself, a killed peer, SIGTERM to one process
(preemption), and checkpoints restored across process counts (1×8 → 2×4, 2×4 → 2×4, 2×4 → 1×8),
all held to the losses of one uninterrupted process of 8 devices. Subprocesses with timeouts and
their own ports.

The slow tests form one chain (module fixtures): the 1×8 reference; a SLURM-style 2×4 run that
resumes the reference's step 2 (1×8 → 2×4) and whose process 1 is killed after step 5, resumed on
both processes (2×4 → 2×4, W&B on) and stopped by SIGTERM to process 1 alone after one step, then
finished in 1×8; and `theseus launch -n 2` evaluating the reference. Each process costs seconds of
CPU to start, and a step of several processes about a second (every collective goes through gloo
on loopback), so each run serves every test that can read it and the runs of several processes
train few steps. (Every process writes the session's compilation cache: tests/subprocess_site.)
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support import TINY_GPT, invoke, subprocess_env
from wandb_records import read_run, run_files

from theseus.distributed.join import differing_processes, mismatch_message
from theseus.distributed.launch import check_command, free_port
from theseus.distributed.supervise import (
    lost_processes,
    report_uncaught,
    restart_command,
    stopped_paragraph,
)
from theseus.plot import read_metrics

STEPS = 16  # room after step 5 (the kill) and after the resume (SIGTERM) on a fast machine
EARLY_STEP = 2  # the reference's checkpoint that the SLURM-style run resumes (1×8 → 2×4)
KILL_AFTER = 5  # the step after which that run's process 1 is killed
WANDB = ["logging.wandb.project=theseus-tests", "logging.wandb.mode=offline"]
ARGS = ["--tp", "2", "--fsdp", *TINY_GPT, f"training.steps={STEPS}", "checkpointing.keep=20"]
TIMEOUT_S = 300


def child_env(**extra):
    """Processes share the test session's compilation cache (tests/conftest.py)."""
    return {**subprocess_env(), **extra}


def theseus(*args):
    return [sys.executable, "-m", "theseus", *map(str, args)]


def run(argv, **env):
    result = subprocess.run(
        argv,
        check=False,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def losses(run_dir):
    rows = read_metrics(run_dir)
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows]


def assert_same_losses(run, reference, steps=range(1, STEPS + 1)):
    """The losses of ``run`` (a run directory or its recorded losses) are those of the run
    directory ``reference`` to 1e-5, at ``steps``."""
    recorded = run if isinstance(run, list) else losses(run)
    got = {step: (loss, val) for step, loss, val in recorded}
    assert sorted(got) == list(steps)
    for step, ref_loss, ref_val in losses(reference):
        if step in got:
            loss, val = got[step]
            assert loss == pytest.approx(ref_loss, rel=1e-5), step
            assert (val is None) == (ref_val is None), step
            if val is not None:
                assert val == pytest.approx(ref_val, rel=1e-5), step


def resumable_copy(source, target, last_step):
    """A copy of a run directory whose newest checkpoint is ``last_step``."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("logs"))
    for step_dir in (target / "checkpoints").iterdir():
        if not step_dir.name.isdigit() or int(step_dir.name) > last_step:
            shutil.rmtree(step_dir)
    return target


def slurm_env(process_id, port):
    """What srun sets for task ``process_id`` of 2 on one node (the variables JAX reads)."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": str(process_id),
        "SLURM_LOCALID": str(process_id),
        "JAX_COORDINATOR_PORT": str(port),
        "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
    }


def start_slurm_task(process_id, port, out, *extra):
    return subprocess.Popen(
        theseus("train", "--cpu-devices", 4, "--distributed", "auto", "--out", out, *ARGS, *extra),
        env=child_env(**slurm_env(process_id, port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killed as a whole, like a lost node
    )


def finish(processes):
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=TIMEOUT_S))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return outputs


def train_here(*args):
    """`theseus train` in this process, one process of 8 devices (tests/conftest.py), which
    saves starting one (interpreter, imports, JAX): its output."""
    result = invoke("train", *args)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process of 8 devices, uninterrupted: the losses every other layout must give."""
    out = tmp_path_factory.mktemp("mp") / "reference"
    train_here("--out", out, *ARGS)
    return out


def trained_steps(metrics) -> list[int]:
    """The steps ``metrics.jsonl`` holds now (a line being written is not one yet)."""
    steps = []
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            break
    return steps


@pytest.fixture(scope="module")
def killed(tmp_path_factory, reference):
    """A SLURM-style 2×4 run that resumes the reference's step 2 (1×8 → 2×4) and whose process 1
    is killed after step 5; checks the survivor's end.

    Returns the run directory, the losses it recorded, process 0's stdout and stderr, and the
    seconds it took to end after the kill (the heartbeat timeout, 5 s here, bounds it)."""
    out = resumable_copy(reference, tmp_path_factory.mktemp("mp") / "slurm", EARLY_STEP)
    port = free_port()
    extra = ["--heartbeat-timeout", 5, "--resume"]
    processes = [start_slurm_task(i, port, out, *extra) for i in range(2)]
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + TIMEOUT_S
        # The copy holds the reference's 16 rows until the resume keeps its first 2.
        while not KILL_AFTER <= len(trained_steps(metrics)) < STEPS:
            assert all(p.poll() is None for p in processes), finish(processes)
            assert time.monotonic() < deadline, f"no step {KILL_AFTER} in time"
            time.sleep(0.1)
        os.killpg(processes[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, stderr = processes[0].communicate(timeout=90)
        waited = time.monotonic() - killed_at
    finally:
        finish(processes)
    return out, losses(out), stdout, stderr, waited


@pytest.mark.slow
def test_slurm_environment_joins_and_a_dead_peer_ends_the_job_cleanly(killed, reference):
    out, recorded, stdout, stderr, waited = killed
    assert stdout.startswith("processes: 0 of 2 (slurm cluster detected); 4 local cpu device(s)")
    assert f"resumed from step {EARLY_STEP}" in stdout
    assert waited < 60, stderr
    assert "process 1 of this job stopped responding" in stderr, stderr
    assert "Traceback" not in stderr and "Check failure" not in stderr, stderr
    assert f"{out}/checkpoints/" in stderr and "--resume" in stderr
    assert (out / "logs" / "process-0.log").read_text().count("heartbeat") > 0
    assert len(recorded) >= KILL_AFTER
    assert_same_losses(recorded, reference, steps=range(1, len(recorded) + 1))  # 1×8 → 2×4


@pytest.fixture(scope="module")
def stopped_after_resume(killed):
    """The killed run resumed (2×4 → 2×4, W&B enabled on this resume) and SIGTERM to process 1
    alone once process 0 said it resumed: (the step it resumed from, outputs, exit statuses, the
    newest checkpoint then)."""
    out = killed[0]
    resumed_from = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    port = free_port()
    processes = [start_slurm_task(i, port, out, "--resume", *WANDB) for i in range(2)]
    try:
        line = processes[0].stdout.readline()
        while line and not line.startswith("resumed from step"):
            line = processes[0].stdout.readline()
        assert line.startswith(f"resumed from step {resumed_from}"), finish(processes)
        processes[1].send_signal(signal.SIGTERM)  # to its supervisor, which passes it on
    finally:
        outputs = finish(processes)
    newest = max(int(p.name) for p in (out / "checkpoints").iterdir())
    return resumed_from, outputs, [p.returncode for p in processes], newest


@pytest.fixture(scope="module")
def finished_in_one_process(killed, stopped_after_resume):
    """The stopped 2×4 run resumed again and finished by one process of 8 devices: its output."""
    return train_here("--out", killed[0], "--resume", *ARGS)


@pytest.mark.slow
def test_resume_after_a_dead_peer_stops_on_sigterm_and_gives_the_uninterrupted_losses(
    killed, stopped_after_resume, finished_in_one_process, reference
):
    """The killed run resumed (2×4 → 2×4) and SIGTERM to process 1 alone once process 0 said
    it resumed, before its first step: both processes finish that same step (JAX's preemption
    sync point), save it and exit with status 4; W&B, enabled on this resume, gets one run (by
    process 0) of that step (the sync point is keyed by the loop's count of
    steps; keyed by the run's step, a notice before the first step was ignored by a resumed run:
    bench/sigterm_resumed.py). Resumed again (in one process:
    test_two_process_checkpoint_restores_into_one_process), the run ends with the uninterrupted
    losses, so the 2×4 step after the resume restored the whole state exactly."""
    resumed_from, outputs, statuses, newest = stopped_after_resume
    assert statuses == [4, 4], outputs
    stop = resumed_from + 1
    for _, stderr in outputs:  # the same step on both processes
        assert f"stopped: preempted (SIGTERM): finished step {stop} of {STEPS}" in stderr, outputs
    assert newest == stop
    (wandb_run,) = [read_run(path) for path in run_files(killed[0])]  # by process 0 alone
    assert wandb_run.logged_steps == [stop]
    assert "done:" in finished_in_one_process
    assert_same_losses(killed[0], reference)  # 2×4 → 2×4 → 1×8


@pytest.mark.slow
def test_launch_evaluates_in_two_processes_the_recorded_validation_loss(reference):
    """`theseus launch -n 2` (2×4) runs `theseus evaluate` as it runs `train`: the validation loss
    the one-process run recorded at its last step (tp=2 + FSDP), to 1e-6, written once
    (eval.json); only process 0 reports, each line names its process, native chatter stays in
    the logs. (SLURM-style joins: the tests above; task scores through `theseus launch`:
    test_harness.py.)"""
    launch = ["launch", "-n", 2, "--cpu-devices-per-process", 4, "--"]
    result = run(theseus(*launch, "evaluate", reference))
    lines = result.stdout.splitlines()
    assert "[0] processes: 0 of 2 (coordinator 127.0.0.1:" in lines[0] + lines[1], lines
    assert any(line.startswith(f"[0] evaluated {reference} at step {STEPS}") for line in lines)
    assert not any(line.startswith("[1] evaluated") for line in lines)
    assert all(line.startswith(("[0] ", "[1] ")) for line in lines), lines
    assert "Gloo" not in result.stdout
    recorded = losses(reference)[-1][2]
    evaluated = json.loads((reference / "eval.json").read_text())
    assert evaluated["step"] == STEPS and evaluated["policy"]["tp"] == 2
    assert evaluated["val_loss"] == pytest.approx(recorded, rel=1e-6)


@pytest.mark.slow
def test_two_process_checkpoint_restores_into_one_process(
    killed, stopped_after_resume, finished_in_one_process, reference
):
    """The checkpoint that SIGTERM made two processes save restores into one process of 8
    devices and gives the uninterrupted losses (2×4 → 1×8)."""
    out, stop = killed[0], stopped_after_resume[0] + 1
    assert f"resumed from step {stop}" in finished_in_one_process
    record = json.loads((out / "run.json").read_text())
    assert record["num_processes"] == 1 and record["mesh_shape"] == {"batch": 4, "shard": 2}
    assert_same_losses(out, reference)  # 2×4 → 1×8


# --- fast checks of the pieces ---------------------------------------------------------------


def test_lost_processes_are_read_from_jax_reports():
    heartbeat = (
        "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n3\n"
        "The tasks have crashed."
    )
    assert lost_processes(heartbeat) == [1, 3]
    leader = "Either the leader task was preempted/died/restarted unexpectedly or ..."
    assert lost_processes(leader) == [0]
    assert lost_processes("Aborted") is None


def test_a_jax_runtime_error_waits_in_the_log_for_the_runtimes_verdict():
    """A failed collective (a JAX runtime error) goes to the log and waits for JAX's runtime to
    end the worker; when it does not, the error is shown as any other, which is shown at once."""
    import io

    import jax

    shown = []
    for error, wait_s in [
        (jax.errors.JaxRuntimeError("Connection reset by peer"), 0.2),
        (ZeroDivisionError("a bug"), 60),
    ]:
        log = io.StringIO()
        started = time.monotonic()
        report_uncaught(
            type(error),
            error,
            None,
            log=log,
            wait_s=wait_s,
            show=lambda kind, e, tb: shown.append(e),
        )
        waited = time.monotonic() - started
        assert shown[-1] is error
        if isinstance(error, ZeroDivisionError):
            assert log.getvalue() == "" and waited < 1
        else:
            assert "JaxRuntimeError: Connection reset by peer" in log.getvalue()
            assert waited >= wait_s


def test_restart_command_resumes_instead_of_overwriting():
    argv = ["train", "--overwrite", "--out", "runs/a b", "model.n_layer=2"]
    assert restart_command(argv, resume=True) == (
        "theseus train --out 'runs/a b' model.n_layer=2 --resume"
    )
    fresh = restart_command(["train", "--resume", "--out", "runs/a"], resume=False)
    assert fresh == "theseus train --out runs/a --overwrite"


def test_a_stopped_evaluate_is_started_again_not_resumed(tmp_path):
    """`evaluate` reads a run that has checkpoints: a lost peer says to start it again."""
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    argv = ["evaluate", str(tmp_path), "--tasks", "arc_easy"]
    paragraph = stopped_paragraph(argv, tmp_path, 1, signal.SIGKILL, "")
    assert f"start every process again, on this one: theseus evaluate {tmp_path}" in paragraph
    assert "--resume" not in paragraph


def test_corpus_mismatch_names_the_processes_that_differ():
    rows = np.array([[90, 10, 7], [90, 10, 7], [91, 10, 7], [90, 10, 8]])
    differing = differing_processes(rows)
    assert differing == [2, 3]
    message = mismatch_message("corpus", ["train_tokens", "validation", "crc"], rows, differing)
    assert "process(es) [2, 3] differ from process 0" in message
    assert "process 2: train_tokens 91, validation 10, crc 7" in message


def test_launch_rejects_commands_it_cannot_start():
    with pytest.raises(ValueError, match="starts one of the commands"):
        check_command(["plan"], None)
    check_command(["evaluate", "runs/a", "--tasks", "arc_easy"], 2)
    with pytest.raises(ValueError, match="--process-id, --cpu-devices"):
        check_command(["train", "--process-id", "1", "--cpu-devices=2"], 4)
    check_command(["train", "--cpu-devices", "8"], None)


def test_distributed_flags_are_checked_before_anything_starts(tmp_path):
    cases = [
        (["--distributed", "bogus"], "JAX's cluster detection methods"),
        (["--distributed", "slurm"], "JAX does not find a slurm environment"),
        (["--distributed", "off", "--coordinator", "127.0.0.1:9"], "contradicts --coordinator"),
        (["--coordinator", "127.0.0.1:9", "--num-processes", "2"], "needs --num-processes and"),
    ]
    for extra, fragment in cases:
        result = invoke("train", "--out", tmp_path / "x", *extra)
        assert result.exit_code == 2 and fragment in result.output, result.output
    joined = ["--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1"]
    result = invoke("train", *joined)
    assert result.exit_code == 2 and "a multi-process run needs --out" in result.output
    assert not (tmp_path / "x").exists()
