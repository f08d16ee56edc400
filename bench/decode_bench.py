"""Decode speed: the compiled KV-cache step against a plain JAX loop that recomputes the full
forward pass for every new token, both greedy, batch 8, on this machine's first device.

    python bench/decode_bench.py [--new-tokens 256] [--prompt-len 64] [--batch 8] [--repeats 3]

The model is the default GPT (4 layers, 128 wide, 256 byte tokens) with ``block_size`` raised to
prompt + new tokens; its parameters are random (speed does not depend on them). Both sides
compile once before timing; the no-cache loop keeps the sequence in a fixed-width buffer (one
compile) and jits its whole step (forward, argmax, write). The two must pick the same tokens.
"""

from __future__ import annotations

import argparse
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from theseus.config import apply_overrides
from theseus.inference import Generator, Sampling
from theseus.jobs import get_job
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology

GPTTrainer = get_job("gpt/train/pretrain").trainer_class
GPTTrainerConfig = GPTTrainer.config_class


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    width = args.prompt_len + args.new_tokens
    config = apply_overrides(
        GPTTrainerConfig(), [f"model.block_size={width}", "training.batch_size=8"]
    )
    policy = ShardingPolicy(tp=1, zero=False)
    trainer = GPTTrainer(config, policy, Topology.new(policy, jax.devices()[:1]))
    params = trainer.init_state().params
    prompts = np.random.default_rng(0).integers(0, 256, (args.batch, args.prompt_len)).tolist()

    generator = Generator(trainer, params)

    def cached():
        return generator.generate_ids(
            prompts, max_new_tokens=args.new_tokens, sampling=Sampling(temperature=0)
        )

    cached()  # compile
    cached_runs = [cached() for _ in range(args.repeats)]
    cached_ids = cached_runs[0].ids
    cached_rate = max(run.tokens_per_s for run in cached_runs)

    def step(params, buffer, position):  # buffer (batch, width): tokens so far, then zeros
        model = nnx.merge(trainer.graphdef, params)
        logits = model(buffer)  # (batch, width, vocab): the whole forward, every token
        chosen = jnp.argmax(logits[:, position - 1], axis=-1).astype(jnp.int32)  # (batch,)
        return jax.lax.dynamic_update_slice(buffer, chosen[:, None], (0, position)), chosen

    step = jax.jit(step, donate_argnums=1)

    def plain():
        buffer = np.zeros((args.batch, width), np.int32)
        buffer[:, : args.prompt_len] = prompts
        buffer = jnp.asarray(buffer)
        start = time.perf_counter()
        chosen = []
        for position in range(args.prompt_len, width):
            buffer, token = step(params, buffer, position)
            chosen.append(token)
        ids = np.stack(jax.device_get(chosen), axis=1)
        return ids, args.batch * args.new_tokens / (time.perf_counter() - start)

    plain()  # compile
    plain_runs = [plain() for _ in range(args.repeats)]
    plain_rate = max(rate for _, rate in plain_runs)
    same = np.array_equal(plain_runs[0][0], cached_ids)
    print(
        f"default GPT, block_size {width}, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {jax.devices()[0].platform}; best of {args.repeats}"
    )
    print("| decode | tokens/s |")
    print("|---|---|")
    print(f"| KV cache (one compiled prefill + decode step) | {cached_rate:,.0f} |")
    print(f"| full forward per token (plain JAX loop) | {plain_rate:,.0f} |")
    print(f"ratio: {cached_rate / plain_rate:.1f}x; same greedy tokens: {same}")
    if not same:
        raise SystemExit("the two decoders chose different tokens")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # generation's notes
    main()
