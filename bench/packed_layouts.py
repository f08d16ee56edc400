"""Packed rows of 4,096 tokens under every layout against one device (issue 36, "Layouts").

    PYTHONPATH=. python bench/packed_layouts.py [--seq 4096] [--steps 2]

A tiny Llama (hidden 64, 4 query and 2 key/value heads, 2 layers, vocabulary 256) on 8 simulated
CPU devices takes ``--steps`` steps of the test suite's equivalence setup (a global batch of 32
rows, AdamW at 1e-3; tests/support.py) on packed rows of ``--seq`` tokens: each row is cut into
segments of random lengths, a quarter of them 1 token long, with trained tokens that differ wildly
between rows and padding at the end of some (``support.uneven_batch``). The attention is the CPU
default, the blockwise kernel in blocks of 512, so a row spans 8 query and key blocks that
segments start inside. Under tp=2, FSDP and tp=2 + FSDP, each with 4 accumulation steps, the
losses and the parameters after the last step are compared with one device holding the whole
batch. Prints a markdown table; exits 1 when a loss differs by more than the suite's relative
tolerance (``support.LOSS_RTOL``, 1e-5) or a parameter by more than its absolute one
(``support.PARAM_ATOL``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
    + " --xla_cpu_collective_timeout_seconds=600"
).strip()
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from theseus.cli.options import size_cpu_thread_pools  # noqa: E402 (the environment first)

size_cpu_thread_pools(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from support import (  # noqa: E402 - the suite's equivalence harness, defined once
    LOSS_RTOL,
    PARAM_ATOL,
    LlamaConfig,
    one_device_run,
    policy_config,
    policy_id,
    run_steps,
    shared_trainer,
    uneven_batch,
)

from theseus.sharding.axis import ShardingPolicy  # noqa: E402

POLICIES = (ShardingPolicy(tp=2), ShardingPolicy(tp=1, fsdp=True), ShardingPolicy(tp=2, fsdp=True))
ACCUMULATION = 4
ONE_TOKEN_SHARE = 0.25  # of the segments: 1 token long
LONGEST = 1500  # tokens of the other segments (2 to LONGEST)


def random_cuts(index: int, j: int, width: int) -> np.ndarray:
    """Where row ``j`` of step ``index`` starts its segments: after random lengths, a quarter of
    them 1 token (a segment that trains nothing and attends only itself), the rest 2 to
    ``LONGEST`` tokens."""
    rng = np.random.default_rng([index, j, 0x5E6])
    lengths = np.where(
        rng.random(width) < ONE_TOKEN_SHARE, 1, rng.integers(2, LONGEST + 1, width)
    )  # (width,): far more than a row needs
    ends = np.cumsum(lengths)  # (width,)
    return ends[ends < width]


def model(seq: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=seq,
    )


def packed_batch(trainer, index: int) -> jax.Array:
    """Step ``index``'s packed rows, cut by :func:`random_cuts`."""
    return uneven_batch(trainer, index, random_cuts)


def differences(got, want) -> tuple[float, float, float, float]:
    """Largest absolute and relative differences of the losses, then of the parameters (relative
    to the largest magnitude of their tensor)."""
    loss_abs = np.abs(got.losses - want.losses)
    params = zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True)
    param_abs, param_rel = 0.0, 0.0
    for value, expected in params:
        gap = float(np.abs(np.asarray(value) - np.asarray(expected)).max())
        param_abs = max(param_abs, gap)
        param_rel = max(param_rel, gap / float(np.abs(expected).max()))
    return (
        float(loss_abs.max()),
        float((loss_abs / np.abs(want.losses)).max()),
        param_abs,
        param_rel,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    def config(policy: ShardingPolicy):
        return policy_config(policy, ACCUMULATION, model(args.seq), f"training.seq_len={args.seq}")

    start = time.perf_counter()
    want = one_device_run(config(POLICIES[0]), args.steps, batches=packed_batch)
    width = args.seq + 1
    cuts = [random_cuts(i, j, width) for i in range(args.steps) for j in range(32)]
    one_token = sum(int((np.diff(c, prepend=0, append=width) == 1).sum()) for c in cuts)
    print(f"packed rows of {args.seq} tokens, {args.steps} steps, global batch 32, accumulation "
          f"{ACCUMULATION}: {sum(c.size + 1 for c in cuts)} segments, {one_token} of 1 token; "
          f"one-device losses {np.round(want.losses, 6).tolist()}\n")  # fmt: skip
    print("| layout | loss abs | loss rel | param abs | param rel |")
    print("|---|---|---|---|---|")
    failed = False
    for policy in POLICIES:
        trainer = shared_trainer(config(policy), policy)
        got = run_steps(trainer, args.steps, batches=packed_batch)
        loss_abs, loss_rel, param_abs, param_rel = differences(got, want)
        failed |= loss_rel > LOSS_RTOL or param_abs > PARAM_ATOL
        print(f"| {policy_id(policy)} | {loss_abs:.2e} | {loss_rel:.2e} | {param_abs:.2e} | "
              f"{param_rel:.2e} |", flush=True)  # fmt: skip
    print(f"\nlimits: loss rel {LOSS_RTOL:g}, param abs {PARAM_ATOL:g}; "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
