"""Packed against padded preference pairs: pair tokens per second of the same train step.

Both layouts train the same Llama (one device, float32) on rows of ``--seq-len + 1`` tokens and
``--rows`` rows a step; ``padded`` holds one pair a row (as TRL's collator pads each pair to the
longest), ``packed`` as many whole pairs as fit. The length mix is stated: prompts uniform in
[8, 64) tokens, each completion uniform in [4, 96), so a pair holds 16 to 254 tokens (mean about
135) and a row of 512 tokens takes the longest pair. The figure is the ratio of non-padding
tokens per second (median step time over ``--steps`` steps after one warm-up step).

    python bench/preference_bench.py [--steps 6] [--seq-len 511] [--rows 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from theseus.config import apply_overrides
from theseus.data.packing import SEGMENTS
from theseus.data.pairs import PairSampler, examples_of_pairs
from theseus.jobs import get_job
from theseus.model.families.llama import LlamaConfig
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology

MODEL = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)


def pairs(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    made = []
    for _ in range(count):
        prompt = rng.integers(0, MODEL.vocab_size, rng.integers(8, 64))
        sides = [rng.integers(0, MODEL.vocab_size, rng.integers(4, 96)) for _ in range(2)]
        masks = [np.r_[np.zeros(prompt.size), np.ones(s.size)] for s in sides]
        ids = [np.concatenate([prompt, s]) for s in sides]
        made.append((ids[0], masks[0], ids[1], masks[1]))
    return examples_of_pairs(made)


def tokens_per_second(layout: str, args: argparse.Namespace) -> tuple[float, float]:
    """Non-padding tokens per second of ``layout``, and its rows' non-padding fraction."""
    cls = get_job("llama/train/preference").trainer_class
    settings = [
        f"training.batch_size={args.rows}",
        f"training.per_device_batch_size={args.rows}",
        f"training.seq_len={args.seq_len}",
        "preference.reference=precomputed",
    ]
    config = apply_overrides(cls.config_class(model=MODEL), settings)
    policy = ShardingPolicy()
    trainer = cls(config, policy, Topology.new(policy, devices=jax.devices()[:1]))
    sampler = PairSampler(pairs(4096), args.seq_len, 0, "error", layout, "bench")
    state = trainer.init_state()
    times, tokens = [], []
    for index in range(args.steps + 1):
        batch = sampler.global_batch(index * args.rows, 1, args.rows)
        placed = trainer.put_batch(lambda r, b=batch: b[:, r], batch.shape)
        began = time.perf_counter()
        state, metrics = trainer.train_step(state, placed)
        jax.block_until_ready(metrics)
        if index:  # the first step compiles
            times.append(time.perf_counter() - began)
            tokens.append(int((batch[:, :, SEGMENTS] > 0).sum()))
    return statistics.median(tokens) / statistics.median(times), sampler.packing.efficiency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=511)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    padded, padded_fill = tokens_per_second("padded", args)
    packed, packed_fill = tokens_per_second("packed", args)
    print(
        f"padded: {padded:,.0f} tokens/s (rows {padded_fill:.0%} full); packed: {packed:,.0f} "
        f"tokens/s (rows {packed_fill:.0%} full); packed / padded = {packed / padded:.2f}"
    )


if __name__ == "__main__":
    main()
