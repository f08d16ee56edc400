"""Speed records: FLOPs per token, peaks and MFU, step times in metrics.jsonl, TensorBoard events
and the GPU benchmark's CPU behaviour."""

import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from theseus.base.axis import ShardingPolicy
from theseus.config import apply_overrides
from theseus.training.flops import FlopsCount, device_peak, xla_flops_per_token
from theseus.training.gpt import GPTTrainer, GPTTrainerConfig
from theseus.training.throughput import Speedometer

REPO = Path(__file__).resolve().parents[1]
GPT_12x768 = ("model.n_layer=12", "model.n_embd=768", "model.n_head=12")


@pytest.mark.parametrize("model", [(), GPT_12x768], ids=["default", "12x768"])
def test_gpt_analytic_flops_match_xla(model):
    config = apply_overrides(GPTTrainerConfig(), [*model, "training.per_device_batch_size=1"])
    trainer = GPTTrainer(config, ShardingPolicy())
    analytic, xla = trainer.flops_per_token(), xla_flops_per_token(trainer)
    # XLA also counts biases, LayerNorm, softmax and the loss, which the formula leaves out.
    assert analytic <= xla <= 1.10 * analytic


def device(kind, platform="gpu"):
    return SimpleNamespace(device_kind=kind, platform=platform)


def test_peak_table_override_and_unknown_devices():
    assert device_peak(device("NVIDIA H100 80GB HBM3"), "bfloat16").flops_per_s == 989.4e12
    assert device_peak(device("NVIDIA H100 PCIe"), "float32").flops_per_s == 378e12
    assert device_peak(device("TPU v5 lite", "tpu"), "bfloat16").flops_per_s == 197e12
    assert device_peak(device("cpu", "cpu"), "bfloat16", 2.5).flops_per_s == 2.5e12
    cpu = device_peak(device("cpu", "cpu"), "float32")
    assert cpu.flops_per_s is None and "--peak-tflops" in cpu.source
    flops = FlopsCount(6e6, "test")
    assert "mfu" not in Speedometer(1000, flops, cpu, 8).rates(0.5)
    h100 = Speedometer(1000, flops, device_peak(device("NVIDIA H100"), "bfloat16"), 8)
    assert h100.rates(0.5)["mfu"] == pytest.approx(6e6 * 2000 / (8 * 989.4e12))


def load_gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_refuses_cpu_and_dry_runs(capsys, monkeypatch):
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):  # --dry-run sets them; restore them after
        monkeypatch.setenv(name, os.environ.get(name, ""))
    gpu = load_gpu_bench()
    assert gpu.main([]) == 2
    refused = capsys.readouterr().err
    assert "needs a GPU or TPU" in refused and "--dry-run" in refused
    assert gpu.main(["--dry-run", "--policies", "tp=2+FSDP"]) == 0
    table = capsys.readouterr().out
    assert "| tiny | tp=2+FSDP |" in table and "theseus / hand-written" in table
