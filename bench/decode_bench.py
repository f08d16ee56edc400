"""Decode speed: the compiled KV-cache step against a plain JAX loop that recomputes the full
forward pass for every new token, both greedy, batch 8, on this machine's first device.

    python bench/decode_bench.py [--new-tokens 256] [--prompt-len 64] [--batch 8] [--repeats 3]

The model is the default GPT (4 layers, 128 wide, 256 byte tokens) with ``block_size`` raised to
prompt + new tokens; its parameters are random (speed does not depend on them). Both sides
compile once before timing; the no-cache loop keeps the sequence in a fixed-width buffer (one
compile) and jits its whole step (forward, argmax, write). The two must pick the same tokens.

Then the cache's memory where layers slide: a 6-layer Gemma (hidden 256, 4 heads, 2 key/value
heads) with windows of 512, all sliding (Mistral's layout) and five sliding to one full (Gemma
3's), 4 rows of ``--cache-len`` positions: the cache's bytes against a whole-context cache for
every layer, and the compiled decode step's temporaries (XLA's ``memory_analysis``).
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from theseus.config import apply_overrides
from theseus.inference import Generator, Sampling
from theseus.jobs import families, get_job
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology

GPTTrainer = get_job("gpt/train/pretrain").trainer_class
GPTTrainerConfig = GPTTrainer.config_class
GEMMA = families()["gemma"].family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-len", type=int, default=8192)
    args = parser.parse_args()
    speed(args)
    cache_memory(args.cache_len)


def speed(args: argparse.Namespace) -> None:
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


def cache_memory(cache_len: int, rows: int = 4) -> None:
    gemma = GEMMA
    base = dict(hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=6, sliding_window=512)
    layouts = {
        "all sliding": None,
        "5 sliding : 1 full": ("sliding_attention",) * 5 + ("full_attention",),
    }
    print(f"\n6-layer Gemma, windows of 512, {rows} rows × {cache_len:,} positions, float32")
    print("| layers | cache MiB | whole-context cache MiB | decode step temporaries MiB |")
    print("|---|---|---|---|")
    for name, types in layouts.items():
        config = gemma.config_class(**base, layer_types=types, max_position_embeddings=cache_len)
        model = nnx.eval_shape(lambda c=config: gemma.model_class(c, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(model)
        decoder = gemma.decoder(config, jnp.float32, graphdef)
        arrays = decoder.cache(rows, cache_len)
        cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
        ints = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((rows, 1), (rows,))]
        step = jax.jit(decoder, donate_argnums=1).lower(params, cache, *ints).compile()
        size = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(cache))
        whole = 2 * 6 * rows * cache_len * config.n_kv * 4
        temp = step.memory_analysis().temp_size_in_bytes
        print(f"| {name} | {size / 2**20:,.1f} | {whole / 2**20:,.1f} | {temp / 2**20:,.1f} |")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # generation's notes
    main()
