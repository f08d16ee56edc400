"""Two processes of 4 CPU devices each, joined by JAX's distributed runtime on loopback, train
with the numbers of one process of 8 devices (subprocesses with timeouts and their own port)."""

import json
import socket
import subprocess
import sys

import pytest
from support import TINY_GPT, subprocess_env

ARGS = ["--tp", "2", "--fsdp", *TINY_GPT, "training.steps=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args):
    return [sys.executable, "-m", "theseus.cli", "train", *map(str, args)]


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    single = tmp_path / "single"
    subprocess.run(
        cli("--cpu-devices", 8, "--out", single, *ARGS),
        env=subprocess_env(),
        check=True,
        capture_output=True,
        timeout=600,
    )
    multi = tmp_path / "multi"
    port = free_port()
    processes = [
        subprocess.Popen(
            cli(
                "--cpu-devices",
                4,
                "--out",
                multi,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                2,
                "--process-id",
                index,
                *ARGS,
            ),
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in range(2)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=600)[0])
    finally:
        for process in processes:
            process.kill()
    assert [p.returncode for p in processes] == [0, 0], "\n".join(outputs)
    run = json.loads((multi / "run.json").read_text())
    assert run["num_processes"] == 2 and run["mesh_shape"] == {"batch": 4, "shard": 2}
    assert "done:" in outputs[0] and "done:" not in outputs[1]  # only process 0 reports
    got, want = losses(multi), losses(single)
    assert [s for s, _, _ in got] == [1, 2, 3, 4]
    for (_, loss, val), (_, ref_loss, ref_val) in zip(got, want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert (val is None) == (ref_val is None)
        if val is not None:
            assert val == pytest.approx(ref_val, rel=1e-5)
    assert sorted(p.name for p in (multi / "checkpoints").iterdir()) == ["2", "4"]
