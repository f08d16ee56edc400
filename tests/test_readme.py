"""Every command the README shows runs here, in the README's order, in one empty folder: each bash
and python block (a python block starting with ``# file: NAME`` is written, not run), then each
inline command (`theseus ...`, `python ...`) that is not the start of a command a block runs. A
block that cannot run as written on a test machine has a stand-in in ``STAND_INS``, with its
reason; a published ``config.json`` a command reads is written into the folder first
(``HF_CONFIGS``). `theseus` commands, and python blocks that leave JAX's configuration alone, run
in CLI servers (below); a block that configures JAX starts its own process."""

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_server import PYTHON_BLOCK
from support import LLAMA31_8B_CONFIG, subprocess_env

from theseus.plot import read_metrics

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 400
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)
# An inline command: a code span that starts with a program and a space.
INLINE = re.compile(
    r"(?<![`\w])`((?:theseus|python3?|pip|\.venv/bin/\S+|source|bash|srun|mpirun) [^`]*)`"
)

INSTALL_AND_TRAIN = (
    "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e . "
    "&& .venv/bin/theseus train"
)
INSTALL_AND_TEST = (
    "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[test]' "
    "&& .venv/bin/python -m pytest -q"
)
# Published config.json files the README's commands read, written into the folder first (stand-ins
# for the downloaded files: the plan reads no weights).
HF_CONFIGS = {"Llama-3.1-8B": LLAMA31_8B_CONFIG}
# Blocks (by their first line) that a test machine cannot run as written: what runs instead
# (None: nothing here) and why.
STAND_INS: dict[str, tuple[str | None, str]] = {
    INSTALL_AND_TRAIN: (
        "theseus train --steps 1 --out runs/default",
        "the environment is installed already, and the main job's 200 steps cost minutes: its "
        "defaults with 1 step (which validates, as the last step does)",
    ),
    INSTALL_AND_TEST: (
        None,
        "the suite itself: CI's .ci/run runs this command (test_ci_runs_the_readme_commands)",
    ),
    ".venv/bin/pip install -c constraints.txt -e '.[cuda12]'   # NVIDIA GPUs, CUDA 12 driver; "
    "'.[cuda13]' for CUDA 13, '.[tpu]' on a TPU VM": (
        "theseus doctor --json",
        "no accelerator here, and the GPU wheels are gigabytes: doctor on this machine's CPU",
    ),
    "# SLURM: 2 nodes × 8 GPUs, one task per node seeing its 8 GPUs": (
        None,
        "needs a SLURM or MPI cluster: tests/test_multiprocess.py joins two plain `theseus train` "
        "processes through a SLURM-style environment",
    ),
}


def blocks() -> list[tuple[str, str]]:
    """The README's bash and python blocks, in order."""
    return [
        (lang, code)
        for lang, code in FENCE.findall(README.read_text())
        if lang in {"bash", "python"}
    ]


def first_line(code: str) -> str:
    return code.strip().splitlines()[0]


def shell_commands(code: str) -> list[str]:
    """The commands of a bash block: continuations joined, comments and blank lines dropped."""
    joined = code.replace("\\\n", " ")
    lines = (re.sub(r"(^|\s+)#.*$", "", line).strip() for line in joined.splitlines())
    return [" ".join(line.split()) for line in lines if line]


def block_commands() -> list[str]:
    """Every command the bash blocks run (stand-ins excepted)."""
    return [
        command
        for lang, code in blocks()
        if lang == "bash" and first_line(code) not in STAND_INS
        for command in shell_commands(code)
    ]


def inline_commands() -> list[str]:
    """Inline commands that are not the start of a command a block runs, once each."""
    run = block_commands()
    found = dict.fromkeys(" ".join(span.split()) for span in INLINE.findall(README.read_text()))
    return [c for c in found if not any(r == c or r.startswith(c + " ") for r in run)]


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines; move details to docs/ (at most {MAX_LINES})"
    )


def test_every_block_runs_or_has_a_stand_in():
    """No command hides in a fence this test does not run (text, yaml, an unnamed language), and
    no stand-in outlives its block."""
    languages = {lang for lang, _ in FENCE.findall(README.read_text())}
    assert languages <= {"bash", "python"}, f"README fences this test does not run: {languages}"
    shown = {first_line(code) for _, code in blocks()}
    stale = sorted(set(STAND_INS) - shown)
    assert not stale, f"STAND_INS names blocks the README no longer has: {stale}"


def test_ci_runs_the_readme_commands():
    """CI installs with the README's constraints and test extra and runs the README's test
    command, so the second install line is what CI checks."""
    ci = (ROOT / ".ci/run").read_text()
    assert "pip install -q -c constraints.txt -e '.[test," in ci
    assert "\n.venv/bin/python -m pytest -q\n" in ci
    for command in (INSTALL_AND_TRAIN, INSTALL_AND_TEST):
        assert f"```bash\n{command}\n```" in README.read_text()


def theseus_command() -> str:
    """The installed entry point when there is one (CI), else the module."""
    script = Path(sys.executable).parent / "theseus"
    return str(script) if script.exists() else f"{sys.executable} -m theseus"


# `theseus` in a block: a command that passes `--cpu-devices N` runs in the server of N devices
# when there is one, any other in the server of one device (tests/cli_server.py); a command no
# server takes starts its own process.
THESEUS = """theseus() {
  local server=one previous=
  for argument in "$@"; do
    if [ "$previous" = --cpu-devices ]; then server="cpu$argument"; fi
    previous=$argument
  done
  if [ ! -p "$SERVERS/$server.in" ]; then COMMAND "$@"; return; fi
  printf '%s\\0' "$@" > "$SERVERS/$server.args"
  echo > "$SERVERS/$server.in"
  local status
  read -r status < "$SERVERS/$server.out"
  cat "$SERVERS/$server.stdout"
  cat "$SERVERS/$server.stderr" >&2
  return "$status"
}
"""
SERVED_DEVICES = (None, 8)  # the counts the README's commands use


def run_in(folder: Path, servers: Path, language: str, code: str) -> None:
    if language == "python" and "jax.config.update(" not in code:  # JAX as it starts: served
        language, code = "bash", f"theseus {PYTHON_BLOCK} {shlex.quote(code)}"
    env = subprocess_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["SERVERS"] = str(servers)
    if language == "python":
        command = [sys.executable, "-c", code]
    else:
        prelude = THESEUS.replace("COMMAND", theseus_command())
        prelude += f'python3() {{ "{sys.executable}" "$@"; }}\n'
        command = ["bash", "-euo", "pipefail", "-c", prelude + code]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"failed:\n{code}\n{done.stdout}\n{done.stderr}"


@contextlib.contextmanager
def cli_servers(folder: Path, servers: Path) -> Iterator[None]:
    """A server of each device count in SERVED_DEVICES, working in ``folder``, for the block's
    `theseus` commands (tests/cli_server.py); ended when the test ends, passed or not."""
    script = Path(__file__).with_name("cli_server.py")
    started = []
    try:
        for devices in SERVED_DEVICES:
            name = "one" if devices is None else f"cpu{devices}"
            extra = [] if devices is None else [str(devices)]
            server = subprocess.Popen(
                [sys.executable, str(script), str(servers), name, *extra],
                cwd=folder, env=subprocess_env(), stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            started.append((name, server))
            assert server.stdout is not None and server.stdout.readline() == "ready\n"
        yield
        for name, server in started:
            (servers / f"{name}.in").open("w").close()  # the end of its requests
            assert server.wait(timeout=60) == 0
    finally:
        for _, server in started:  # waited for: their CPU counts in the suite's
            server.kill()
            server.wait()


def run_readme(folder: Path, servers: Path) -> None:
    """Every block and inline command, in the README's order, in ``folder``."""
    for name, config in HF_CONFIGS.items():
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
    for language, code in blocks():
        named = re.match(r"# file: (\S+)\n", code)
        if language == "python" and named:
            (folder / named.group(1)).write_text(code)
        elif first_line(code) in STAND_INS:
            stand_in, _why = STAND_INS[first_line(code)]
            if stand_in:
                run_in(folder, servers, "bash", stand_in)
        else:
            run_in(folder, servers, language, code)
    for command in inline_commands():
        run_in(folder, servers, "bash", command)


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    folder, servers = tmp_path / "readme", tmp_path / "servers"
    folder.mkdir()
    servers.mkdir()
    with cli_servers(folder, servers):
        run_readme(folder, servers)

    runs = folder / "runs"
    (default_row,) = map(json.loads, (runs / "default/metrics.jsonl").read_text().splitlines())
    assert default_row["step"] == 1 and "val_loss" in default_row
    assert (runs / "chain/00-gpt-train-pretrain/loss.png").stat().st_size > 1000
    chain_run = json.loads((runs / "chain/00-gpt-train-pretrain/run.json").read_text())
    assert chain_run["policy"]["tp"] == 2 and chain_run["policy"]["fsdp"] is True  # flags merged
    assert chain_run["mesh_shape"] == {"batch": 4, "shard": 2}
    # `evaluate` scores the newest checkpoint on the run's held-out batches: the training run's
    # last validation loss, in the run's layout (the chains) and on one device (LoRA, trained
    # under tp=2 + FSDP on 8).
    for run, evaluated, rtol in (
        ("chain/00-gpt-train-pretrain", "chain/01-gpt-evaluate", 1e-6),
        ("py-chain/00-gpt-train-pretrain", "py-chain/01-gpt-evaluate", 1e-6),
        ("lora", "lora", 1e-5),
    ):
        last = read_metrics(runs / run)[-1]
        scores = json.loads((runs / evaluated / "eval.json").read_text())
        assert scores["step"] == last["step"]
        assert scores["val_loss"] == pytest.approx(last["val_loss"], rel=rtol), (run, scores)
    assert (runs / "quick/metrics.jsonl").is_file()
    assert len((runs / "mine/metrics.jsonl").read_text().splitlines()) == 6
    (extended,) = json.loads((runs / "mine/run.json").read_text())["resumes"]  # no --allow-changes
    assert extended["from_step"] == 4
    assert extended["changes"] == [{"key": "training.steps", "old": 4, "new": 6}]
    assert (runs / "bigram/run.json").is_file()
    assert (runs / "bpe/tokenizer.json").is_file()
    assert (runs / "imported/run.json").is_file()
    assert (runs / "lora/run.json").is_file()
    assert (folder / "hf/merged/config.json").is_file()
    assert (folder / "plan.json").stat().st_size > 0
