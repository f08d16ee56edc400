"""GPU/TPU benchmark: GPT-2 small (124M) and a 350M GPT in bfloat16 on the accelerators present.

    python bench/gpu.py                 # on a machine with a GPU or TPU; under 8 minutes on one H100
    python bench/gpu.py --dry-run       # tiny GPT on CPU: checks the script itself in seconds

For every policy that fits the device count, it compiles theseus's train step, trains ``--steps``
steps after a warm-up and prints one table row: step time, tokens/s, MFU (model FLOPs per token
from ``GPTTrainer.flops_per_token()``, peak from ``theseus.training.flops.PEAK_TFLOPS``) and the
compiled step's peak memory per device. In the same run it times the hand-written ``jax.jit`` +
optax step of ``bench/reference.py`` (same model math and layouts, same starting parameters) and
prints theseus / hand-written. Timing blocks only at the end of each timed run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

# name: GPT hyperparameters (vocabulary padded from 50257 to a multiple of 128)
MODELS = {
    "gpt2-124M": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304},
    "gpt-350M": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50304},
}
DRY_RUN_MODEL = {"tiny": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256}}
# name: (tp, zero, fsdp, fewest devices)
POLICIES = {
    "DP": (1, False, False, 1),
    "ZeRO": (1, True, False, 2),
    "FSDP": (1, True, True, 2),
    "tp=2": (2, True, False, 2),
    "tp=2+FSDP": (2, True, True, 4),
}


@dataclass(frozen=True)
class Row:
    model: str
    policy: str
    step_s: float
    tokens_per_s: float
    mfu: float | None
    peak_bytes: int
    reference_step_s: float

    def render(self) -> str:
        mfu = f"{self.mfu:.1%}" if self.mfu is not None else "n/a"
        return (
            f"| {self.model} | {self.policy} | {self.step_s * 1e3:.1f} | {self.tokens_per_s:,.0f} | "
            f"{mfu} | {self.peak_bytes / 2**30:.2f} | {self.step_s / self.reference_step_s:.3f} |"
        )


HEADER = (
    "| model | policy | step ms | tokens/s | MFU | compiled peak GiB/device | "
    "theseus / hand-written |\n|---|---|---|---|---|---|---|"
)


def timed(step, state, batch, steps: int) -> tuple[object, float]:
    """Seconds per step over ``steps`` steps, blocking once at the end."""
    import jax

    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - start) / steps


def bench_one(model_name, hyper, policy_name, args, log) -> Row:
    import jax
    import numpy as np
    import reference

    from theseus.config import apply_overrides
    from theseus.jobs import get_job
    from theseus.sharding.axis import ShardingPolicy
    from theseus.training.flops import device_peak

    GPTTrainer = get_job("gpt/train/pretrain").trainer_class
    GPTTrainerConfig = GPTTrainer.config_class

    tp, zero, fsdp, _ = POLICIES[policy_name]
    num_devices = jax.device_count()
    replicas = num_devices // tp
    overrides = [f"model.{k}={v}" for k, v in hyper.items()] + [
        f"model.block_size={args.seq_len}",
        f"training.dtype={args.dtype}",
        f"training.per_device_batch_size={args.per_device_batch_size}",
        f"training.batch_size={args.per_device_batch_size * replicas}",
        f"training.steps={args.steps + args.warmup}",
    ]
    config = apply_overrides(GPTTrainerConfig(), overrides)
    trainer = GPTTrainer(config, ShardingPolicy(tp=tp, zero=zero, fsdp=fsdp))
    start = time.perf_counter()
    memory = trainer.compile()
    step = memory.executable
    compile_s = time.perf_counter() - start
    state = trainer.init_state()
    plan = trainer.batch_plan
    shape = (plan.accumulation_steps, plan.examples_per_microbatch, plan.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, hyper["vocab_size"], shape, dtype=np.int32)
    batch = jax.device_put(tokens, trainer.batch_sharding)
    params = jax.tree.map(lambda a: a.copy(), state.params)  # the theseus step donates its state

    ref = reference.build(
        reference.Model(
            block_size=args.seq_len, compute_dtype=jax.numpy.dtype(args.dtype), **hyper
        ),
        reference.Sharding(tp, zero, fsdp),
    )
    ref_state = ref.init(params)
    del params
    ref_batch = jax.device_put(tokens, ref.batch_sharding)

    seconds, ref_seconds = [], []
    state, _ = timed(step, state, batch, args.warmup)
    ref_state, _ = timed(ref.run, ref_state, ref_batch, args.warmup)
    for repeat in range(args.repeats):  # interleaved, so drifts hit both alike
        if repeat % 2:
            ref_state, r = timed(ref.run, ref_state, ref_batch, args.steps)
            state, s = timed(step, state, batch, args.steps)
        else:
            state, s = timed(step, state, batch, args.steps)
            ref_state, r = timed(ref.run, ref_state, ref_batch, args.steps)
        seconds.append(s)
        ref_seconds.append(r)
    step_s, ref_s = statistics.median(seconds), statistics.median(ref_seconds)
    tokens_per_s = plan.global_batch_size * plan.seq_len / step_s
    peak = device_peak(jax.devices()[0], args.dtype)
    mfu = None
    if peak.flops_per_s is not None:
        mfu = trainer.flops_per_token() * tokens_per_s / (peak.flops_per_s * num_devices)
    log(
        f"{model_name} {policy_name}: {trainer.num_params:,} parameters, {plan.describe()}; "
        f"compiled in {compile_s:.1f} s; peak: {peak.source}"
    )
    return Row(model_name, policy_name, step_s, tokens_per_s, mfu, memory.peak, ref_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny GPT on CPU, few steps")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help="those that fit are run")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repetition")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--per-device-batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.policies.split(",")) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if args.dry_run:  # float32 and little XLA optimisation: bfloat16 compiles slowly on CPU
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
        ).strip()
        models = DRY_RUN_MODEL
        args.steps, args.repeats, args.warmup, args.seq_len = 2, 1, 1, 16
        args.per_device_batch_size, args.dtype = 2, "float32"
    else:
        unknown = sorted(set(args.models.split(",")) - set(MODELS))
        if unknown:
            parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
        models = {name: MODELS[name] for name in args.models.split(",")}
    import jax

    devices = jax.devices()
    if devices[0].platform == "cpu" and not args.dry_run:
        print(
            f"bench/gpu.py needs a GPU or TPU, but JAX sees only {len(devices)} CPU device(s) "
            f"(jax {jax.__version__}). Install a JAX build for your accelerator (e.g. `pip "
            "install 'jax[cuda12]'`) and check `python -c 'import jax; print(jax.devices())'`; "
            "`--dry-run` runs a tiny model on CPU to check the script itself.",
            file=sys.stderr,
        )
        return 2
    num_devices = len(devices)
    fitting = [
        name
        for name in args.policies.split(",")
        if POLICIES[name][3] <= num_devices and num_devices % POLICIES[name][0] == 0
    ]
    print(
        f"{num_devices} × {devices[0].device_kind} ({devices[0].platform}), jax {jax.__version__}; "
        f"{args.dtype}, {args.per_device_batch_size} × {args.seq_len} tokens per replica; "
        f"median of {args.repeats} × {args.steps} steps after {args.warmup} warm-up; policies "
        f"that fit {num_devices} device(s): {', '.join(fitting)}",
        flush=True,
    )
    rows = []
    for model_name, hyper in models.items():
        for policy_name in fitting:
            rows.append(bench_one(model_name, hyper, policy_name, args, print))
    print()
    print(HEADER)
    for row in rows:
        print(row.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
