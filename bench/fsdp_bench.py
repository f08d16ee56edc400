"""Memory and communication of the compiled train step, per policy (compile only, nothing runs).

Two tables, per device and per step:

- ``--devices 8`` (default): a small GPT on 8 simulated CPU devices, tp=1, one example per
  replica per microbatch, with 1 and 8 accumulation steps: compiled peak and temporaries, and
  the bytes of each kind of collective (loops unrolled; :mod:`theseus.accounting.collectives`).
- ``--scale``: the 7.5B GPT of issue 8 on 64 simulated devices (bf16, 1 × 2048 tokens per
  device): compiled peak, temporaries, all-gather bytes and matmul FLOPs of FSDP at 36 and 72
  layers under each recompute policy (``none``, ``full``, ``dots``) and, for ``none`` and
  ``full``, with gathers in the compute and in the storage dtype; ZeRO and DP at 36.

    PYTHONPATH=. python bench/fsdp_bench.py [--scale]

Prints markdown tables; asserts nothing (the tests do).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEVICES = 64 if "--scale" in sys.argv else 8
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support import GPT_7_5B  # noqa: E402 - the 7.5B GPT of the tests, defined once

SMALL = [
    "model.vocab_size=256",
    "model.block_size=64",
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_embd=192",
    "training.per_device_batch_size=1",
]
# The 7.5B GPT of the tests, with the vocabulary of GPT-2 padded to 50304 (as first measured;
# it divides by 64) and bfloat16 compute; each row sets its own depth.
BIG = [
    *GPT_7_5B,
    "model.vocab_size=50304",
    "training.batch_size=64",
    "training.per_device_batch_size=1",
    "training.dtype=bfloat16",
]
GB = 1e9
REMAT = ("none", "full", "dots")
GATHER = ("compute", "storage")


def compiled(policy, overrides: list[str]):
    """(seconds, CompiledMemory with collectives) of the GPT train step on this process."""
    from theseus.config import apply_overrides
    from theseus.jobs import get_job
    from theseus.plan import plan

    GPTTrainer = get_job("gpt/train/pretrain").trainer_class
    GPTTrainerConfig = GPTTrainer.config_class

    config = apply_overrides(GPTTrainerConfig(), overrides)
    start = time.perf_counter()
    result = plan(
        GPTTrainer, config, policy, DEVICES, compile=True, alternatives=False, compare_remat=False
    )
    return time.perf_counter() - start, result.compiled


def collectives_of(memory):
    from theseus.accounting.collectives import count_collectives

    return count_collectives(memory.executable.as_text())


def small_table() -> None:
    from theseus.sharding.axis import ShardingPolicy

    policies = {
        "DP": ShardingPolicy(zero=False),
        "ZeRO": ShardingPolicy(),
        "FSDP": ShardingPolicy(fsdp=True),
    }
    print(
        "compiled train step on 8 simulated CPU devices, per device per step: GPT n_layer=4 "
        "n_embd=192 vocab=256, 1 example x 64 tokens per replica per microbatch"
    )
    print()
    print(
        "| policy | accumulation | peak bytes | temporaries | all-gather bytes (count) | "
        "reduce-scatter bytes (count) | all-reduce bytes (count) | all collective bytes |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, policy in policies.items():
        for accumulation in (1, 8):
            _, memory = compiled(policy, [*SMALL, f"training.batch_size={8 * accumulation}"])
            found = collectives_of(memory)
            cells = [
                f"{found[op].bytes:,} ({found[op].count})"
                for op in ("all-gather", "reduce-scatter", "all-reduce")
            ]
            print(
                f"| {name} | {accumulation} | {memory.peak:,} | {memory.temporaries:,} | "
                + " | ".join(cells)
                + f" | {found.bytes:,} |"
            )


def scale_table() -> None:
    from theseus.sharding.axis import ShardingPolicy

    fsdp = {remat: ShardingPolicy(fsdp=True, activation_checkpointing=remat) for remat in REMAT}
    rows = [
        *(("FSDP", fsdp["full"], layers, gather) for layers in (36, 72) for gather in GATHER),
        *(("FSDP", fsdp["none"], layers, gather) for layers in (36, 72) for gather in GATHER),
        *(("FSDP", fsdp["dots"], layers, "compute") for layers in (36, 72)),
        ("ZeRO", ShardingPolicy(activation_checkpointing="full"), 36, "compute"),
        ("DP", ShardingPolicy(zero=False, activation_checkpointing="full"), 36, "compute"),
    ]
    print(
        "7.5B GPT (n_embd=4096, 36 or 72 layers) on 64 simulated devices, bf16 compute, "
        "1 x 2048 tokens per device, per device per step (compile only):"
    )
    print()
    print(
        "| policy | recompute | layers | gather dtype | peak GB | temporaries GB | "
        "all-gather GB (count) | all collectives GB | matmul TFLOPs | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, policy, n_layer, gather in rows:
        overrides = [*BIG, f"model.n_layer={n_layer}", f"training.gather_dtype={gather}"]
        seconds, memory = compiled(policy, overrides)
        found = collectives_of(memory)
        print(
            f"| {name} | {policy.activation_checkpointing} | {n_layer} | {gather} | "
            f"{memory.peak / GB:.2f} | {memory.temporaries / GB:.2f} | "
            f"{found['all-gather'].bytes / GB:.1f} ({found['all-gather'].count}) | "
            f"{found.bytes / GB:.1f} | {memory.dot_flops / 1e12:.1f} | {seconds:.0f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", action="store_true", help="the 7.5B table on 64 devices")
    args = parser.parse_args()
    scale_table() if args.scale else small_table()


if __name__ == "__main__":
    main()
