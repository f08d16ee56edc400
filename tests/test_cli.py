"""The command line: bad input gets one paragraph, exit status 2, and loses no file; a run killed
with SIGKILL resumes and matches an uninterrupted run."""

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import TINY_GPT, invoke, subprocess_env

from theseus.plot import read_metrics

TINY = [*TINY_GPT, "training.steps=4"]


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def assert_user_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("error: ")
    for fragment in fragments:
        assert fragment in result.output, result.output


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    result = invoke("train", "--out", run_dir, *TINY)
    assert result.exit_code == 0, result.output
    assert "batch: 2 per replica × 8 replicas × 1 accumulation steps = 16 examples" in result.output
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(finished_run, target)
    return target


def test_help_explains_flags():
    result = invoke("train", "--help")
    assert result.exit_code == 0
    for flag in (
        "--tp",
        "--fsdp",
        "--zero",
        "--cpu-devices",
        "--steps",
        "--seed",
        "--peak-tflops",
        "--out",
        "--resume",
        "--overwrite",
    ):
        assert flag in result.output
    # Defaults written into help texts survive Rich's markup (unescaped, "[default: 1]" vanished).
    words = " ".join(result.output.replace("│", " ").split())  # the table's wrapped cells
    for default in ("[default: 1]", "[default: on]", "[default: auto]", "[default: 30]"):
        assert default in words
    for command in ("run", "configure", "jobs", "plot"):
        assert invoke(command, "--help").exit_code == 0


def test_jobs_lists_registered_jobs():
    result = invoke("jobs")
    assert result.exit_code == 0
    assert "gpt/train/pretrain" in result.output and "gpt/evaluate" in result.output


def test_missing_and_empty_data_path(tmp_path):
    out = tmp_path / "out"
    assert_user_error(
        invoke("train", "--out", out, *TINY, f"data.path={tmp_path}/nope.txt"), "nope.txt"
    )
    (tmp_path / "empty.txt").write_text("")
    assert_user_error(
        invoke("train", "--out", out, *TINY, f"data.path={tmp_path}/empty.txt"), "empty.txt"
    )
    assert not out.exists()


def test_bad_sharding_and_config(tmp_path):
    out = tmp_path / "out"
    cases = [
        (["--tp", "3"], ["tp=3 does not divide the 8 local devices"]),
        (["--fsdp", "--no-zero"], ["FSDP requires ZeRO"]),
        (["--fsdp", "model.n_embd=100"], ["blocks/attn_q/kernel: shape (2, 100, 100)", "batch=8"]),
        (["training.batch_size=30"], ["batch_size=30", "per_device_batch_size=2", "8 replicas"]),
        (["training.bogus=1"], ["unknown config key 'training.bogus'", "accepted keys"]),
        (["--job", "nope/train"], ["unknown job 'nope/train'"]),
        (["--peak-tflops", "0"], ["logging.peak_tflops=0.0", "greater than 0"]),
    ]
    for extra, fragments in cases:
        assert_user_error(invoke("train", "--out", out, *TINY, *extra), *fragments)
    assert not out.exists()


def test_refuses_to_mix_runs(run_copy):
    before = snapshot(run_copy)
    assert_user_error(
        invoke("train", "--out", run_copy, *TINY), "already holds a run", "--resume", "--overwrite"
    )
    assert snapshot(run_copy) == before


def test_incompatible_checkpoint_keeps_files(run_copy):
    before = snapshot(run_copy)
    extra = [*TINY, "model.n_embd=40", "--resume"]
    assert_user_error(invoke("train", "--out", run_copy, *extra), "checkpoint")
    assert snapshot(run_copy) == before


def test_damaged_checkpoints(run_copy):
    # Damage the newest step: resume falls back to the previous good one.
    newest = run_copy / "checkpoints" / "4"
    for path in newest.rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "meta" not in str(path):
            path.write_bytes(b"\0" * path.stat().st_size)
    result = invoke("train", "--out", run_copy, *TINY, "--resume")
    assert result.exit_code == 0, result.output
    assert "resumed from step 2" in result.output
    # Damage every step: resume fails and leaves the files alone.
    for step in (run_copy / "checkpoints").iterdir():
        for path in step.rglob("*"):
            if path.is_file() and path.stat().st_size > 0:
                path.write_bytes(b"garbage")
    before = snapshot(run_copy)
    assert_user_error(invoke("train", "--out", run_copy, *TINY, "--resume"), "checkpoint")
    assert snapshot(run_copy) == before


def test_resume_without_checkpoints(tmp_path):
    assert_user_error(invoke("train", "--out", tmp_path, *TINY, "--resume"), "nothing to resume")


def test_run_flags_that_contradict_each_other(tmp_path):
    """One RunMode checks the combination, for `train` and `run` alike (before any work)."""
    out = tmp_path / "out"
    for command in (["train", "--out", out], ["run", tmp_path / "chain.yaml", out]):
        for flags, fragments in [
            (["--resume", "--overwrite"], ["--resume and --overwrite", "choose one"]),
            (["--allow-changes"], ["--allow-changes", "applies to --resume only"]),
        ]:
            assert_user_error(invoke(*command, *flags), *fragments)
    assert not (tmp_path / "out").exists()


def test_overwrite_replaces_previous_run(run_copy):
    (run_copy / "notes.txt").write_text("mine")
    result = invoke("train", "--out", run_copy, *TINY, "--overwrite", "training.steps=2")
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run_copy)] == [1, 2]
    assert (run_copy / "notes.txt").read_text() == "mine"  # not a theseus file: kept


def test_configure_run_and_plot(tmp_path):
    chain_file = tmp_path / "chain.yaml"
    result = invoke(
        "configure", "gpt/train/pretrain", chain_file, *TINY, "--tp", "2", "--then", "gpt/evaluate"
    )
    assert result.exit_code == 0, result.output
    assert_user_error(invoke("configure", "gpt/train/pretrain", chain_file), "exists")
    result = invoke("run", chain_file, tmp_path / "out", "--fsdp")
    assert result.exit_code == 0, result.output
    run = json.loads((tmp_path / "out" / "00-gpt-train-pretrain" / "run.json").read_text())
    assert run["policy"]["tp"] == 2 and run["policy"]["fsdp"] is True
    assert (tmp_path / "out" / "01-gpt-evaluate" / "eval.json").is_file()
    result = invoke("plot", tmp_path / "out" / "00-gpt-train-pretrain")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "00-gpt-train-pretrain" / "loss.png").stat().st_size > 1000


def cli(*args):
    return [sys.executable, "-m", "theseus", *[str(a) for a in args]]


def interrupt(run_dir: Path, args: list, signum: int) -> subprocess.CompletedProcess:
    """Start a run, send ``signum`` once it has saved step 10, and wait for it to end."""
    process = subprocess.Popen(
        cli("train", "--out", run_dir, *args),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            steps = [int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
            if steps and max(steps) >= 10:
                break
            assert process.poll() is None, "the run ended before it could be interrupted"
            time.sleep(0.05)
        process.send_signal(signum)
        output = process.communicate(timeout=120)[0]
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, output)


@pytest.mark.slow
def test_sigkill_or_sigterm_then_resume_matches_uninterrupted(tmp_path):
    """SIGKILL: resume from the newest committed step. SIGTERM (preemption): the current step
    is finished and saved, exit status 4. Either way the resumed run equals an uninterrupted one
    bit for bit."""
    args = [
        "--cpu-devices",
        "4",
        "--tp",
        "2",
        "--fsdp",
        *TINY,
        "training.steps=40",
        "checkpointing.interval=5",
        "checkpointing.async_save=true",
    ]
    full = tmp_path / "full"
    subprocess.run(
        cli("train", "--out", full, *args),
        env=subprocess_env(),
        check=True,
        capture_output=True,
        timeout=600,
    )

    def losses(run_dir):
        rows = read_metrics(run_dir)
        return {r["step"]: (r["loss"], r.get("val_loss")) for r in rows}

    for signum in (signal.SIGKILL, signal.SIGTERM):
        run_dir = tmp_path / signum.name
        ended = interrupt(run_dir, args, signum)
        saved = max(int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit())
        if signum == signal.SIGKILL:
            assert ended.returncode == -signal.SIGKILL
        else:
            assert ended.returncode == 4, ended.stdout
            assert "Traceback" not in ended.stdout
            message = f"stopped: preempted (SIGTERM): finished step {saved} of 40 and saved it"
            assert message in ended.stdout
            assert saved < 40 and sorted(losses(run_dir)) == list(range(1, saved + 1))
        resumed = subprocess.run(
            cli("train", "--out", run_dir, *args, "--resume"),
            env=subprocess_env(),
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed from step {saved}" in resumed.stdout
        assert losses(run_dir) == losses(full)
