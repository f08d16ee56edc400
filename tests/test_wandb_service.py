"""Weights & Biases whose own service dies during a run: the real wandb package, offline."""

import subprocess
import sys

from support import subprocess_env

# A W&B run's service (wandb-core, a child of this process) is killed after the first row; the
# rows after it and the close fail inside the guard, and the process exits on its own.
SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from theseus.config import WandbConfig
from theseus.training.run.dashboards import GuardedDashboard
from theseus.training.run.wandb_writer import WandbWriter

out = Path(sys.argv[1])
config = WandbConfig(project="p", mode="offline")
writer = WandbWriter(out, config, run_id="deadbeef", run_config={})
with GuardedDashboard(writer, "W&B") as board:
    board.write({"step": 1, "loss": 2.0})
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and b"wandb-core" in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
                while (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    time.sleep(0.01)
        except OSError:
            pass
    time.sleep(1)  # the client sees the connection close
    for step in (2, 3, 4):
        board.write({"step": step, "loss": 2.0})
print("the run went on")
"""


def test_a_dead_wandb_service_is_one_line_and_no_traceback_at_exit(tmp_path):
    """wandb-core killed mid-run: one line says W&B failed and names the cause, one that it
    could not be closed, one the steps it did not get; exit 0 and no traceback (W&B's exit hook
    printed one when its service had died; the writer now ends the service with the run)."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=subprocess_env() | {"WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output and "Exception ignored" not in output, output
    lines = output.splitlines()
    assert [line for line in lines if line.startswith("W&B")] == [
        "W&B failed at step 2 (ConnectionResetError: Connection lost); training goes on and "
        "every row is in metrics.jsonl; W&B gets the rows it missed if it works again during "
        "the run",
        "W&B could not be closed (ConnectionResetError: Connection lost)",
        "W&B did not get steps 2-4 (metrics.jsonl holds every row)",
    ], output
    assert done.stdout == "the run went on\n"
