"""The command line: bad input gets one paragraph, exit status 2, and loses no file; a run killed
with SIGKILL and preempted with SIGTERM resumes and matches an uninterrupted run."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import TINY_GPT, invoke, read_events, subprocess_env, write_mixture
from typer.testing import CliRunner
from wandb_records import read_run, run_files

from theseus.plot import read_metrics
from theseus.training.run.tensorboard import TensorBoardWriter
from theseus.training.run.wandb_writer import wandb_row

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
    for command in ("run", "evaluate", "configure", "jobs", "plot"):
        assert invoke(command, "--help").exit_code == 0


def test_command_list_shows_each_description_on_whole_lines():
    """Typer lists a command with its docstring's first paragraph, line breaks kept: each one is
    a single line, so the list wraps at the terminal's width, never mid-sentence."""
    from typer.main import get_command

    from theseus.cli.app import app

    commands = get_command(app).commands
    output = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    rows = {line.split()[1]: line for line in output.splitlines() if line.startswith("│ ")}
    for name, command in commands.items():
        first = command.help.strip().split("\n\n")[0]
        assert "\n" not in first, f"{name}: first paragraph spans lines: {first!r}"
        assert first in rows[name], (name, output)  # the whole description on its own row


def test_jobs_lists_registered_jobs():
    result = invoke("jobs")
    assert result.exit_code == 0
    assert "gpt/train/pretrain" in result.output and "gpt/evaluate" in result.output


def test_import_hf_help_names_the_registered_families(monkeypatch):
    """import-hf reads every registered family: its help lists them from the registry, each
    with the Hugging Face model types it reads, a family registered later included."""
    import theseus.jobs

    mine = dataclasses.replace(theseus.jobs.families()["llama"], name="mine")
    monkeypatch.setitem(theseus.jobs._FAMILIES, "mine", mine)
    result = invoke("import-hf", "--help")
    assert result.exit_code == 0, result.output
    words = " ".join(result.output.split())
    for name, registered in theseus.jobs.families().items():
        assert f"{name}: {', '.join(registered.family.hf.model_types)}" in words, words
    assert "mine: llama, mistral, qwen2, qwen3" in words


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


def test_wandb_without_the_package_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds when absent
    out = tmp_path / "out"
    result = invoke("train", "--out", out, *TINY, "logging.wandb.project=p")
    assert_user_error(result, "logging.wandb.project='p'", "pip install 'theseus[wandb]'")
    assert not out.exists()


def test_wandb_online_without_credentials_writes_nothing(tmp_path, monkeypatch):
    """No API key and no terminal to ask for one: said before anything is written (wandb.init
    failed with a traceback after the compile, leaving run.json and config.yaml behind)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    out = tmp_path / "out"
    result = invoke("train", "--out", out, *TINY, "logging.wandb.project=p")
    assert_user_error(result, "no credentials", "wandb login", "logging.wandb.mode=offline")
    assert not out.exists()


def assert_same_arrays(step_dir: Path, other: Path) -> None:
    """Two checkpoint steps hold the same state, array for array, bit for bit (their files
    differ: orbax names its data files at random and writes times)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    mine, theirs = (
        ocp.StandardCheckpointer().restore(p.absolute() / "state") for p in (step_dir, other)
    )
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, b), mine, theirs)))


class RefusingWandbRun:
    """What ``wandb.init`` returns, whose ``log`` refuses the calls numbered in ``refused``
    (from 1) as a network outage would; it records the steps it got."""

    def __init__(self, refused: range):
        self.refused, self.calls, self.steps = refused, 0, []

    def log(self, data: dict, step: int) -> None:
        self.calls += 1
        if self.calls in self.refused:
            raise ConnectionError("wandb.ai: Network is unreachable\nretrying later")
        assert data["loss"] == data["loss"]  # a row, read back or not, holds its loss
        self.steps.append(step)

    def finish(self, exit_code: int) -> None:
        self.exit_code = exit_code


def fill_tensorboards_disk(monkeypatch, *refused: range) -> None:
    """The writes numbered in ``refused[i]`` (from 1) of the i-th TensorBoard writer made meet a
    full disk: its event file's descriptor points at /dev/full (ENOSPC from the kernel) while the
    real writer writes."""
    write, counts = TensorBoardWriter.write, {}  # writer: (its index, its writes so far)

    def full_or_not(writer: TensorBoardWriter, row: dict) -> None:
        index, done = counts.get(writer, (len(counts), 0))
        counts[writer] = (index, done + 1)
        events = writer._file.fileno()
        kept = os.dup(events)
        try:
            if done + 1 in refused[index]:
                with open("/dev/full", "wb") as full:
                    os.dup2(full.fileno(), events)
            write(writer, row)
        finally:
            os.dup2(kept, events)
            os.close(kept)

    monkeypatch.setattr(TensorBoardWriter, "write", full_or_not)


def test_dashboards_failing_mid_run_never_stop_training(finished_run, tmp_path, monkeypatch):
    """W&B refusing from step 2 on and TensorBoard's disk full from step 2 on: one line each
    names the cause, training ends with exit 0, every row in metrics.jsonl and the checkpoints
    of the run without them; one line each says which steps it did not get, and a --resume (from
    step 2) writes them first; there each refuses its first calls and catches up (one line each
    way), W&B getting every step once, in order, and TensorBoard's files holding every step."""
    import wandb

    wandb_args = ["logging.wandb.project=p", "logging.wandb.mode=offline"]
    runs = []

    def fake(refused):
        runs.append(RefusingWandbRun(refused))
        monkeypatch.setattr(wandb, "init", lambda **settings: runs[-1])

    def said_failed(output: str, step: int) -> bool:
        return [line for line in output.splitlines() if " failed at step " in line] == [
            f"{name} failed at step {step} ({cause}); training goes on and every row is in "
            f"metrics.jsonl; {name} gets the rows it missed if it works again during the run"
            for name, cause in [
                ("TensorBoard", "OSError: [Errno 28] No space left on device"),
                ("W&B", "ConnectionError: wandb.ai: Network is unreachable"),
            ]
        ]

    out, dashboards = tmp_path / "down", [*wandb_args, "logging.tensorboard=true"]
    fake(range(2, 1000))
    fill_tensorboards_disk(monkeypatch, range(2, 1000), range(1, 2))
    result = invoke("train", "--out", out, *TINY, *dashboards)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and said_failed(result.output, 2)
    lines = result.output.splitlines()
    for name in ("TensorBoard", "W&B"):
        assert f"{name} did not get steps 2-4 (metrics.jsonl holds every row)" in lines
    assert runs[-1].steps == [1] and runs[-1].exit_code == 0
    assert read_events(out / "tensorboard")["loss"].keys() == {1}
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3, 4]
    assert saved_steps(out) == saved_steps(finished_run) == [2, 4]
    for step in (2, 4):
        assert_same_arrays(*(run / "checkpoints" / str(step) for run in (out, finished_run)))
    shutil.rmtree(out / "checkpoints" / "4")
    fake(range(1, 3))  # refuses the first two calls
    result = invoke("train", "--out", out, *TINY, *dashboards, "--resume")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and said_failed(result.output, 2)
    assert runs[-1].steps == [2, 3, 4]  # step 2 from metrics.jsonl, 3 and 4 trained again
    assert read_events(out / "tensorboard")["loss"].keys() == {1, 2, 3, 4}
    assert "missed_from" not in json.loads((out / "wandb-run.json").read_text())
    lines = result.output.splitlines()
    assert "TensorBoard works again at step 3: it caught up on the rows it missed" in lines
    assert "W&B works again at step 4: it caught up on the rows it missed" in lines


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
    """The same program as the finished run's (compiled once); a row only the previous run's
    metrics.jsonl holds is gone."""
    (run_copy / "notes.txt").write_text("mine")
    with (run_copy / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 5, "loss": 1.0}) + "\n")
    result = invoke("train", "--out", run_copy, *TINY, "--overwrite")
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run_copy)] == [1, 2, 3, 4]
    assert (run_copy / "notes.txt").read_text() == "mine"  # not a theseus file: kept


def test_configure_writes_once(tmp_path):
    """`configure` refuses to overwrite; running and plotting the chain it writes, with `run`'s
    sharding flags merged in, is the README's quick start (tests/test_readme.py)."""
    chain_file = tmp_path / "chain.yaml"
    result = invoke(
        "configure", "gpt/train/pretrain", chain_file, *TINY, "--tp", "2", "--then", "gpt/evaluate"
    )
    assert result.exit_code == 0, result.output
    assert_user_error(invoke("configure", "gpt/train/pretrain", chain_file), "exists")


def cli(*args):
    return [sys.executable, "-m", "theseus", *[str(a) for a in args]]


def started(process: subprocess.Popen, ready, what: str) -> None:
    """Wait until ``ready()`` (polled every 50 ms, at most 300 s) while ``process`` runs."""
    deadline = time.time() + 300
    while not ready():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} in time"
        time.sleep(0.05)


def saved_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit())


@pytest.mark.slow
def test_sigkill_and_sigterm_then_resume_match_the_uninterrupted_run(tmp_path):
    """One mixture run under tp=2 + FSDP, interrupted twice: SIGKILL once step 4 is saved (the
    resume starts from the newest committed step), then SIGTERM to the resumed run once it has
    trained (preemption: the current step is finished and saved, exit status 4). Every row's
    losses, validation losses and per-source validation losses equal an uninterrupted run's bit
    for bit. (A resume from a SIGTERM's save, on another layout and process count, to the
    uninterrupted losses: tests/test_multiprocess.py; resumes on other layouts:
    tests/test_checkpoint.py.)

    Every run logs to Weights & Biases, offline: the uninterrupted run's W&B run holds its
    metrics.jsonl, config and run.json; the resumed segment continues the killed one's W&B run
    and logs each step it trains once. (A W&B run catching up after a resume:
    test_dashboards_failing_mid_run_never_stop_training.) Whether the last row, which validates
    and saves, times its step alone is a timing: bench/last_row_bench.py measures it (no timed
    assertion here; one sample of a tiny step on a shared machine was seen at 0.4× the
    median)."""
    sources = write_mixture(tmp_path / "sources")
    steps = 16  # room after the kill (at step 4 or 8) for the resumed run to train before SIGTERM
    # Saved every 4 steps (TINY saves every 2): a save costs more CPU than a tiny step.
    args = [*TINY, f"data.sources={sources}", f"training.steps={steps}", "logging.log_interval=1",
            "checkpointing.interval=4",
            "logging.wandb.project=theseus-tests", "logging.wandb.mode=offline"]  # fmt: skip
    sharded = ["--cpu-devices", "4", "--tp", "2", "--fsdp", *args]
    env = {**subprocess_env(), "PYTHONUNBUFFERED": "1"}
    full, run_dir, output = tmp_path / "full", tmp_path / "interrupted", tmp_path / "output.txt"

    def start(*extra):
        with output.open("w") as file:
            return subprocess.Popen(
                cli("train", "--out", run_dir, *extra),
                env=env,
                stdout=file,
                stderr=subprocess.STDOUT,
            )

    def progress_lines() -> list[str]:  # printed once a step has run: its preemption watch is on
        return [line for line in output.read_text().splitlines() if line.startswith("step ")]

    subprocess.run(cli("train", "--out", full, *sharded), env=env, check=True, timeout=600,
                   capture_output=True)  # fmt: skip
    assert_wandb_holds_the_run(full)

    process = start(*sharded)
    try:
        started(process, lambda: saved_steps(run_dir) and saved_steps(run_dir)[-1] >= 4, "step 4")
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        process.kill()
    killed_at = saved_steps(run_dir)[-1]

    process = start(*sharded, "--resume")
    try:  # once it trains, long before it can finish
        started(process, progress_lines, "a step")
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        process.kill()
    printed = output.read_text()
    assert process.returncode == 4, printed
    assert "Traceback" not in printed and f"resumed from step {killed_at}" in printed
    stopped_at = saved_steps(run_dir)[-1]
    assert killed_at < stopped_at < steps
    stop = f"stopped: preempted (SIGTERM): finished step {stopped_at} of {steps} and saved it"
    assert stop in printed
    timing = ("step_time_s", "tokens_per_s", "trained_tokens_per_s", "mfu")

    def assert_uninterrupted_rows(last_step: int) -> list[dict]:
        rows, uninterrupted = read_metrics(run_dir), read_metrics(full)
        assert [row["step"] for row in rows] == list(range(1, last_step + 1))
        for row, want in zip(rows, uninterrupted[:last_step], strict=True):
            assert {k: v for k, v in row.items() if k not in timing} == {
                k: v for k, v in want.items() if k not in timing
            }  # bit for bit, both sources' validation losses included
        return rows

    rows = assert_uninterrupted_rows(stopped_at)
    # W&B buffers its records in the process: the SIGKILLed segment's file may hold nothing
    # (seen: its 7-byte header alone). The resumed segment logs every step it trains, from the
    # killed run's checkpoint on, each once.
    _killed, resumed = run_files(run_dir)  # one W&B run (one id), in two segments
    wandb_run = read_run(resumed)
    assert wandb_run.run_id == json.loads((run_dir / "wandb-run.json").read_text())["id"]
    assert wandb_run.logged_steps == list(range(killed_at + 1, stopped_at + 1))
    for step, logged_row in wandb_run.rows.items():
        want = wandb_row(rows[step - 1])
        assert {k: v for k, v in logged_row.items() if k not in timing} == {
            k: v for k, v in want.items() if k not in timing
        }, step


def assert_wandb_holds_the_run(run_dir: Path) -> None:
    """One W&B run under ``run_dir`` holding every metrics.jsonl row (equal values), the resolved
    config and run.json."""
    (path,) = run_files(run_dir)
    run = read_run(path)
    assert run.rows == {row["step"]: wandb_row(row) for row in read_metrics(run_dir)}
    assert run.config["run"] == json.loads((run_dir / "run.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert {key: run.config[key] for key in config} == config
