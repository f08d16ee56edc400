"""Attention per kernel and context length: compiled memory, time of forward + backward, blocks
computed against the mask's exact share; and a small Llama's training step, blockwise against the
written-out product (``model.attention=xla``).

    python bench/attention_bench.py [--memory 2048,8192,32768] [--time 2048,8192]
        [--steps 2048,8192] [--repeats 5] [--block 512]

Memory: one attention layer shaped like Llama 3.1 8B's (32 query heads, 8 key/value heads, head
dim 128, batch 1, bfloat16), causal, forward and backward lowered and compiled, not run; XLA's
temp bytes (``memory_analysis().temp_size_in_bytes``). Time: the same causal layer with 8 query
heads, 2 key/value heads and head dim 64 in float32 (the 8B layer's written-out product does not
fit here), the median of ``--repeats`` runs, kernels alternating. Work: the blocks the blockwise
kernel computes (``blocks_computed``, the visibility its loops run over) against the share of
(query, key) pairs the mask reads, for causal, sliding-window (4,096) and packed-document (2,048
each) masks. Step: a 2-layer Llama (hidden 256, 4 heads, 2 key/value heads), one example of
``--steps`` tokens on one CPU device; both kernels start from the same parameters and their first
losses must agree to 1e-5; each repetition times both back to back, the ratio is the median of
the paired ratios. Prints tables; asserts only the loss agreement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from theseus.model.attention import AttentionMask, attention  # noqa: E402
from theseus.model.blockwise import blocks_computed  # noqa: E402

KERNELS = ("blockwise", "xla")


def parse_lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def forward_backward(seq: int, kernel: str, block: int):
    """jit of forward + backward (the output as its own cotangent) of a causal layer."""

    def run(q, k, v):
        def attend(q, k, v):
            mask = AttentionMask.causal(seq)
            return attention(q, k, v, mask, kernel=kernel, block_q=block, block_k=block)

        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    return jax.jit(run)


def memory_table(lengths: list[int], block: int) -> None:
    print("Llama 3.1 8B attention layer (32/8 heads, dim 128, bf16), causal, forward+backward:")
    print(f"{'tokens':>7} {'kernel':>10} {'temp GiB':>10} {'growth':>7}")
    for kernel in KERNELS:
        previous = None
        for seq in lengths:
            q = jax.ShapeDtypeStruct((1, seq, 32, 128), jnp.bfloat16)
            kv = jax.ShapeDtypeStruct((1, seq, 8, 128), jnp.bfloat16)
            compiled = forward_backward(seq, kernel, block).lower(q, kv, kv).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            growth = "" if previous is None else f"{temp / previous:.1f}x"
            print(f"{seq:>7} {kernel:>10} {temp / 2**30:>10.3f} {growth:>7}", flush=True)
            previous = temp


def time_table(lengths: list[int], block: int, repeats: int) -> None:
    print(f"\nCausal layer (8/2 heads, dim 64, f32), forward+backward, median of {repeats}:")
    print(f"{'tokens':>7} {'blockwise s':>12} {'xla s':>8} {'ratio':>6}")
    for seq in lengths:
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (1, seq, 8, 64))
        k, v = (jax.random.normal(key, (1, seq, 2, 64)) for key in keys[1:])
        runs = {kernel: forward_backward(seq, kernel, block) for kernel in KERNELS}
        seconds = {kernel: [] for kernel in KERNELS}
        grads = {kernel: jax.block_until_ready(f(q, k, v)) for kernel, f in runs.items()}
        error = max(
            float(jnp.abs(a - b).max() / jnp.abs(b).max())
            for a, b in zip(grads["blockwise"], grads["xla"], strict=True)
        )
        for repeat in range(repeats):
            for kernel in KERNELS if repeat % 2 == 0 else KERNELS[::-1]:
                start = time.perf_counter()
                jax.block_until_ready(runs[kernel](q, k, v))
                seconds[kernel].append(time.perf_counter() - start)
        a, b = (statistics.median(seconds[kernel]) for kernel in KERNELS)
        print(f"{seq:>7} {a:>12.3f} {b:>8.3f} {a / b:>6.2f}   (gradients differ by {error:.1e})")


def exact_share(positions: np.ndarray, window: int | None) -> float:
    """Share of (query, key) pairs read, for per-document positions (0, 1, ... per document):
    query at position p reads min(p + 1, window) keys."""
    reads = positions + 1 if window is None else np.minimum(positions + 1, window)
    return float(reads.sum()) / positions.size**2


def work_table(seq: int, block: int) -> None:
    print(f"\nBlocks of {block} computed at {seq} tokens (counted by the kernel):")
    print(f"{'mask':>24} {'blocks':>12} {'share':>7} {'exact share':>12}")
    ramp = np.arange(seq)
    documents = ramp % 2048
    causal = AttentionMask.causal(seq)
    segments = jnp.asarray(ramp // 2048)[None]
    masks = {
        "causal": (causal, exact_share(ramp, None)),
        "window 4096": (
            AttentionMask(causal.query_positions, causal.key_positions, window=4096),
            exact_share(ramp, 4096),
        ),
        "packed documents of 2048": (
            AttentionMask(
                jnp.asarray(documents)[None], jnp.asarray(documents)[None], segments, segments
            ),
            exact_share(documents, None),
        ),
    }
    for name, (mask, share) in masks.items():
        count = blocks_computed(mask, seq, seq, block, block)
        print(
            f"{name:>24} {count.computed:>5} / {count.total:<5} "
            f"{count.computed / count.total:>7.3f} {share:>12.3f}"
        )


def llama_step(seq: int, kernel: str):
    from theseus.config import apply_overrides
    from theseus.jobs import get_job
    from theseus.sharding.axis import ShardingPolicy

    trainer_class = get_job("llama/train/pretrain").trainer_class
    overrides = [
        "model.num_layers=2",
        "model.hidden_size=256",
        "model.intermediate_size=688",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        f"model.max_position_embeddings={seq}",
        f"model.attention={kernel}",
        f"training.seq_len={seq}",
        "training.batch_size=1",
        "training.per_device_batch_size=1",
    ]
    config = apply_overrides(trainer_class.config_class(), overrides)
    trainer = trainer_class(config, ShardingPolicy())
    tokens = np.random.default_rng(0).integers(0, 256, trainer.batch_plan.shape, dtype=np.int32)
    batch = jax.device_put(tokens, trainer.batch_sharding)
    return trainer.compile().executable, trainer.init_state(), batch


def step_table(lengths: list[int], repeats: int) -> None:
    print(f"\nLlama training step (2 layers, hidden 256, 4/2 heads), median of {repeats}:")
    print(f"{'tokens':>7} {'blockwise s':>12} {'xla s':>8} {'ratio':>6} {'range':>10} {'loss':>9}")
    for seq in lengths:
        contenders = {kernel: list(llama_step(seq, kernel)) for kernel in KERNELS}
        losses = {}
        for kernel, contender in contenders.items():
            step, state, batch = contender
            contender[1], metrics = step(state, batch)
            losses[kernel] = float(metrics["loss"])
        if abs(losses["blockwise"] - losses["xla"]) > 1e-5:
            raise SystemExit(f"{seq} tokens: the first losses differ: {losses}")
        seconds = {kernel: [] for kernel in KERNELS}
        for repeat in range(repeats):
            for kernel in KERNELS if repeat % 2 == 0 else KERNELS[::-1]:
                step, state, batch = contenders[kernel]
                start = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready((state, metrics))
                seconds[kernel].append(time.perf_counter() - start)
                contenders[kernel][1] = state
        ratios = [a / b for a, b in zip(seconds["blockwise"], seconds["xla"], strict=True)]
        a, b = (statistics.median(seconds[kernel]) for kernel in KERNELS)
        print(
            f"{seq:>7} {a:>12.3f} {b:>8.3f} {statistics.median(ratios):>6.3f} "
            f"{min(ratios):>4.2f}-{max(ratios):<5.2f} {losses['xla']:>9.6f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="2048,8192,32768", help="context lengths")
    parser.add_argument("--time", default="2048,8192", help="context lengths")
    parser.add_argument("--steps", default="2048,8192", help="context lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=512, help="blockwise block size")
    args = parser.parse_args()
    if args.memory:
        memory_table(parse_lengths(args.memory), args.block)
    work_table(32768, args.block)
    if args.time:
        time_table(parse_lengths(args.time), args.block, args.repeats)
    if args.steps:
        step_table(parse_lengths(args.steps), args.repeats)


if __name__ == "__main__":
    main()
