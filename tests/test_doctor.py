"""`theseus doctor`: the report on this CPU machine (8 simulated devices), the warning a user
gets when the system shows GPUs that JAX cannot use, and the attention kernel each backend's
training gets (the accelerators' choices made from this CPU machine, their facts faked)."""

import json
import re
from pathlib import Path

from support import invoke

from theseus.distributed.join import Membership
from theseus.model import kernels
from theseus.training import environment
from theseus.training.environment import SystemFacts, attention_report, environment_report

CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def test_cpu_report_with_simulated_devices():
    result = invoke("doctor", "--cpu-devices", 8, "--json")
    assert result.exit_code == 1, result.output  # the simulation is a warning
    report = json.loads(result.output)
    assert report["backend"] == "cpu"
    assert [(d["platform"], d["count"]) for d in report["devices"]] == [("cpu", 8)]
    assert report["attention"] == {
        "backend": "cpu", "kernel": "blockwise", "fallback": None, "ran": True, "error": None
    }  # fmt: skip
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


def test_the_accelerators_fall_back_to_blockwise_when_their_kernel_refuses():
    """From this CPU, a GPU's and a TPU's choice: their fused kernels refuse (no such device
    here), so training's attention is blockwise, which runs."""
    gpu, tpu = attention_report("gpu"), attention_report("tpu")
    assert (gpu.kernel, gpu.ran, tpu.kernel, tpu.ran) == ("blockwise", True, "blockwise", True)
    assert "cuDNN attention needs an NVIDIA GPU" in gpu.fallback
    assert "splash attention is a TPU kernel" in tpu.fallback
    assert gpu.describe().startswith("attention on gpu (model.attention=auto): blockwise (cuDNN")


def test_a_chosen_kernel_that_does_not_run_is_a_warning(monkeypatch):
    """An NVIDIA GPU with cuDNN (faked): cuDNN is chosen; here it cannot run, and the report
    says so and warns."""
    cuda = kernels.Backend("gpu", nvidia=True, cudnn=True, hopper=True)
    monkeypatch.setattr(kernels, "backend", lambda: cuda)
    report = attention_report("gpu")
    assert (report.kernel, report.fallback, report.ran) == ("cudnn", None, False)
    assert "cuDNN is not detected" in report.error
    system = SystemFacts(packages={}, visible_gpus=(), visible_tpus=(), flags={})
    found = environment.warnings(system, "gpu", {"jax": environment.TESTED_JAX}, None, report)
    assert found == [
        "training's attention (cudnn, chosen by model.attention=auto) did not run here: "
        f"{report.error}; train with model.attention=blockwise"
    ]
