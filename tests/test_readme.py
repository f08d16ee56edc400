"""The README's tutorial runs as written: every block between the tutorial markers, in order, in
an empty folder (python blocks starting with ``# file: NAME`` are written, not run)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import subprocess_env

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```(python|bash)\n(.*?)```", re.DOTALL)


def tutorial_blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    start, end = text.index("<!-- tutorial:start -->"), text.index("<!-- tutorial:end -->")
    return BLOCK.findall(text[start:end])


def theseus_command() -> str:
    """The installed entry point when there is one (CI), else the module."""
    script = Path(sys.executable).parent / "theseus"
    return str(script) if script.exists() else f"{sys.executable} -m theseus"


@pytest.mark.slow
def test_tutorial_runs(tmp_path):
    env = subprocess_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    blocks = tutorial_blocks()
    assert len(blocks) >= 6
    for index, (language, code) in enumerate(blocks):
        named = re.match(r"# file: (\S+)\n", code)
        if language == "python" and named:
            (tmp_path / named.group(1)).write_text(code)
            continue
        if language == "python":
            command = [sys.executable, "-c", code]
        else:
            prelude = (
                f'theseus() {{ {theseus_command()} "$@"; }}\n'
                f'python3() {{ "{sys.executable}" "$@"; }}\n'
            )
            command = ["bash", "-euo", "pipefail", "-c", prelude + code]
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, f"block {index} failed:\n{code}\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "runs/chain/00-gpt-train-pretrain/loss.png").is_file()
    assert (tmp_path / "runs/chain/01-gpt-evaluate/eval.json").is_file()
    assert (tmp_path / "runs/py-chain/01-gpt-evaluate/eval.json").is_file()
    assert (tmp_path / "runs/quick/metrics.jsonl").is_file()
    assert len((tmp_path / "runs/mine/metrics.jsonl").read_text().splitlines()) == 30
    assert (tmp_path / "runs/bigram/run.json").is_file()
    assert (tmp_path / "runs/bpe/tokenizer.json").is_file()
