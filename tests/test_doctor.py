"""`theseus doctor`: the report on this CPU machine (8 simulated devices), and the warning a user
gets when the system shows GPUs that JAX cannot use."""

import json
import re
from pathlib import Path

from support import invoke

from theseus.distributed.join import Membership
from theseus.training import environment
from theseus.training.environment import SystemFacts, environment_report

CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def test_cpu_report_with_simulated_devices():
    result = invoke("doctor", "--cpu-devices", 8, "--json")
    assert result.exit_code == 1, result.output  # the simulation is a warning
    report = json.loads(result.output)
    assert report["backend"] == "cpu"
    assert [(d["platform"], d["count"]) for d in report["devices"]] == [("cpu", 8)]
    assert report["attention"]["llama"] == "xla" and not report["attention"]["cudnn_runs"]
    assert report["peak"]["flops_per_s"] == {"bfloat16": None, "float32": None}
    assert report["versions"]["jax"] == report["tested_jax"] and "jaxlib" in report["versions"]
    assert report["processes"] == {
        "count": 1, "index": 0, "found_by": "single process: no cluster detected"
    }  # fmt: skip
    (simulated,) = report["warnings"]
    assert "8 CPU devices are simulated" in simulated and not report["healthy"]


def test_visible_gpus_without_a_plugin_warn():
    """A system with an NVIDIA device file and no CUDA plugin, as process 2 of a 4-task SLURM
    job (what JAX's detection would find there)."""
    system = SystemFacts(
        packages={"jaxlib": "0.10.2"}, visible_gpus=("/dev/nvidia0",), visible_tpus=(), flags={}
    )
    report = environment_report(system, Membership("slurm", 4, 2), simulated_cpu_devices=None)
    assert "processes: 2 of 4 (slurm detected by JAX)" in report.describe()
    (warning,) = report.warnings
    assert "NVIDIA GPUs (/dev/nvidia0) but JAX runs on the CPU: no CUDA plugin" in warning
    assert "'.[cuda12]'" in warning and not report.healthy
    # Simulated CPU devices on the same node are the user's choice: no plugin warning.
    simulated = environment_report(system, Membership("slurm", 4, 2), simulated_cpu_devices=8)
    assert [w for w in simulated.warnings if "NVIDIA" in w] == []


def test_the_tested_jax_is_the_pinned_one():
    pinned = re.search(r"^jax==(\S+)$", CONSTRAINTS.read_text(), re.MULTILINE)
    assert pinned and pinned.group(1) == environment.TESTED_JAX
