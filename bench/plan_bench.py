"""Benchmark of the planner: time to plan a 7.5B-parameter GPT on 256 devices, model-state totals
against the closed-form ZeRO model, and (``--compiled``) the compiled peak of DP, ZeRO and FSDP
for a small GPT whose parameters dominate its activations, on 8 simulated CPU devices.

    PYTHONPATH=. python bench/plan_bench.py [--compiled]

Prints figures and tables; asserts nothing (the tests do).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support import GPT_7_5B  # noqa: E402 - the 7.5B GPT of the tests, defined once

BIG = [
    *GPT_7_5B,
    "training.batch_size=256",
    "training.per_device_batch_size=1",
]
# Parameters dominate activations: wide layers, one example of 8 tokens per replica.
WIDE = [
    "model.vocab_size=256",
    "model.block_size=8",
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_embd=192",
    "training.batch_size=16",
    "training.per_device_batch_size=1",
]


def cli_seconds(devices: int) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "theseus", "plan", "--devices", str(devices), "--fsdp", *BIG],
        check=True,
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiled", action="store_true", help="also compile DP/ZeRO/FSDP")
    args = parser.parse_args()

    from theseus.config import apply_overrides
    from theseus.jobs import get_job
    from theseus.plan import format_bytes, plan
    from theseus.sharding.axis import ShardingPolicy

    GPTTrainer = get_job("gpt/train/pretrain").trainer_class
    GPTTrainerConfig = GPTTrainer.config_class

    config = apply_overrides(GPTTrainerConfig(), BIG)
    start = time.perf_counter()
    result = plan(GPTTrainer, config, ShardingPolicy(fsdp=True), 256)
    seconds = time.perf_counter() - start
    print(
        f"plan of {result.num_params:,} parameters on 256 devices (12 policies side by side): "
        f"{seconds:.2f} s in process; `theseus plan --devices 256 --fsdp` end to end: "
        f"{cli_seconds(256):.2f} s"
    )
    print()
    print("per-device model state, fp32 AdamW: planner vs closed form (Ψ parameters, N replicas)")
    header = (
        f"{'N':>4}  {'policy':<6} {'formula':<10} {'closed form':>16} {'planner':>16}  "
        f"{'gap':>12}  {'replicated params':>17}  {'planner':>10}"
    )
    print(header)
    for n in (8, 64, 256):
        survey = plan(GPTTrainer, config, ShardingPolicy(zero=False), n)
        for name in ("DP", "ZeRO", "FSDP"):
            option = survey.option(name)
            cf = option.closed_form
            print(
                f"{n:>4}  {name:<6} {cf.formula:<10} {cf.predicted_bytes:>16,.0f} "
                f"{option.totals.total:>16,}  {cf.gap:>12,.0f}  {cf.replicated_params:>17,}  "
                f"{format_bytes(option.totals.total):>10}"
            )
    fsdp_64 = plan(GPTTrainer, config, ShardingPolicy(fsdp=True), 64, alternatives=False)
    print(
        f"FSDP on 64 devices: {fsdp_64.totals.total / 1e9:.3f} GB per device "
        f"(ZeRO paper: 7.5B × 16 bytes / 64 = {7.5e9 * 16 / 64 / 1e9:.3f} GB)"
    )

    if not args.compiled:
        return
    print()
    wide = apply_overrides(GPTTrainerConfig(), WIDE)
    print(
        "compiled train step on 8 simulated CPU devices, per device (bytes): GPT "
        "n_layer=4 n_embd=192 vocab=256, 1 example × 8 tokens per replica"
    )
    print(
        f"{'policy':<8} {'model state':>12} {'arguments':>12} {'temporaries':>12} "
        f"{'outputs':>12} {'peak (sum)':>12} {'compile s':>10}"
    )
    for policy in (ShardingPolicy(zero=False), ShardingPolicy(), ShardingPolicy(fsdp=True)):
        start = time.perf_counter()
        p = plan(GPTTrainer, wide, policy, 8, compile=True, alternatives=False)
        c = p.compiled
        print(
            f"{p.name:<8} {p.totals.total:>12,} {c.arguments:>12,} {c.temporaries:>12,} "
            f"{c.outputs:>12,} {c.peak:>12,} {time.perf_counter() - start:>10.1f}"
        )


if __name__ == "__main__":
    main()
