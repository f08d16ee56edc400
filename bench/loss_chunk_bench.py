"""The loss in chunks of positions against the whole sequence's loss: a small Llama's training
step time and compiled temp bytes, by ``training.loss_chunk``.

    python bench/loss_chunk_bench.py [--seq 2048] [--chunks 256,2048] [--vocab 32000]
        [--repeats 7]

A 2-layer Llama (hidden 256, 4 heads, 2 key/value heads, MLP 688) with a vocabulary of
``--vocab`` (32,000: the head is a large share of the step, as in published models), one example
of ``--seq`` tokens on one CPU device, float32. A chunk of ``--seq`` or more is the whole
sequence at once (the loss before chunking: its logits kept for the backward); a smaller one
runs the head and the cross-entropy in a rematerialised scan (one more head matmul per token).
All start from the same parameters and their first losses must agree to 1e-5; each repetition
times every chunk back to back (order alternating), and the ratio to the first chunk of
``--chunks`` is the median of the paired ratios. Prints a table; asserts only the loss agreement.
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
import numpy as np  # noqa: E402


def llama_step(seq: int, vocab: int, chunk: int):
    """The compiled step, its initial state, a batch and the step's temp bytes."""
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
        f"model.vocab_size={vocab}",
        f"model.max_position_embeddings={seq}",
        f"training.seq_len={seq}",
        f"training.loss_chunk={chunk}",
        "training.batch_size=1",
        "training.per_device_batch_size=1",
    ]
    config = apply_overrides(trainer_class.config_class(), overrides)
    trainer = trainer_class(config, ShardingPolicy())
    shape = trainer.batch_plan.shape
    tokens = np.random.default_rng(0).integers(0, vocab, shape, dtype=np.int32)
    batch = jax.device_put(tokens, trainer.batch_sharding)
    compiled = trainer.compile()
    return [compiled.executable, trainer.init_state(), batch], compiled.temporaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunks", default="256,2048", help="loss chunks; ratios to the first")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]

    contenders, temps, losses = {}, {}, {}
    for chunk in chunks:
        contenders[chunk], temps[chunk] = llama_step(args.seq, args.vocab, chunk)
        step, state, batch = contenders[chunk]
        contenders[chunk][1], metrics = step(state, batch)  # warm-up; the first loss
        losses[chunk] = float(metrics["loss"])
    if max(losses.values()) - min(losses.values()) > 1e-5:
        raise SystemExit(f"the first losses differ: {losses}")
    seconds: dict[int, list[float]] = {chunk: [] for chunk in chunks}
    for repeat in range(args.repeats):
        for chunk in chunks if repeat % 2 == 0 else chunks[::-1]:
            step, state, batch = contenders[chunk]
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            seconds[chunk].append(time.perf_counter() - start)
            contenders[chunk][1] = state
    base = chunks[0]
    print(
        f"Llama step (2 layers, hidden 256, vocabulary {args.vocab:,}), {args.seq:,} tokens, "
        f"median of {args.repeats}; ratios to loss_chunk={base}:"
    )
    print(f"{'chunk':>6} {'s/step':>8} {'ratio':>6} {'range':>10} {'temp bytes':>14} {'loss':>9}")
    for chunk in chunks:
        ratios = [a / b for a, b in zip(seconds[chunk], seconds[base], strict=True)]
        print(
            f"{chunk:>6} {statistics.median(seconds[chunk]):>8.3f} "
            f"{statistics.median(ratios):>6.3f} {min(ratios):>4.2f}-{max(ratios):<5.2f} "
            f"{temps[chunk]:>14,} {losses[chunk]:>9.6f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
