"""GPU/TPU benchmark: GPT-2 small (124M) and a 350M GPT in bfloat16 on the accelerators present,
then one attention layer per kernel.

    python bench/gpu.py                 # on a machine with a GPU or TPU; under 8 minutes on one H100
    python bench/gpu.py --parts attention   # the attention kernels alone (about a minute)
    python bench/gpu.py --dry-run       # tiny GPT and attention on CPU: checks the script itself

For every policy that fits the device count, it compiles theseus's train step, trains ``--steps``
steps after a warm-up and prints one table row: step time, tokens/s, MFU (model FLOPs per token
from ``GPTTrainer.flops_per_token()``, peak from ``theseus.training.flops.PEAK_TFLOPS``) and the
compiled step's peak memory per device. In the same run it times the hand-written ``jax.jit`` +
optax step of ``bench/reference.py`` (same model math and layouts, same starting parameters) and
prints theseus / hand-written. Timing blocks only at the end of each timed run.

The attention part compiles forward and backward of one attention layer shaped like Llama 3.1
8B's (32 query heads, 8 key/value heads, head dim 128, batch 1), causal and with a sliding window,
for each kernel (``attention(..., kernel=...)``: cuDNN's, splash, blockwise, XLA's written out)
and prints its time, its compiled temp bytes, its time / XLA's, and its largest difference from
XLA's output and gradients (of the largest magnitude). A kernel that cannot serve the call prints
its refusal instead.
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


# Llama 3.1 8B's attention layer; the dry run's tiny one.
ATTENTION_LAYER = {"heads": 32, "kv_heads": 8, "head_dim": 128}
DRY_RUN_ATTENTION_LAYER = {"heads": 4, "kv_heads": 2, "head_dim": 16}
ATTENTION_KERNELS = ("cudnn", "splash", "blockwise", "xla")  # xla last: the others meet it
PARTS = ("models", "attention")


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


@dataclass(frozen=True)
class AttentionRow:
    """One kernel on one mask: seconds per forward + backward, compiled temp bytes, the largest
    difference from XLA's output and gradients over their largest magnitude; or a refusal."""

    seq_len: int
    window: int | None
    kernel: str
    step_s: float | None = None
    temp_bytes: int | None = None
    difference: float | None = None
    refusal: str | None = None

    def render(self, xla_s: float | None) -> str:
        mask = f"{self.seq_len} | {self.window or 'causal'} | {self.kernel}"
        if self.step_s is None:
            return f"| {mask} | refused: {self.refusal} | | | |"
        ratio = f"{self.step_s / xla_s:.3f}" if xla_s else "n/a"
        difference = f"{self.difference:.1e}" if self.difference is not None else "n/a"
        return (
            f"| {mask} | {self.step_s * 1e3:.2f} | {self.temp_bytes / 2**30:.3f} | {ratio} | "
            f"{difference} |"
        )


ATTENTION_HEADER = (
    "| tokens | window | kernel | fwd+bwd ms | temp GiB | / xla | max difference from xla |\n"
    "|---|---|---|---|---|---|---|"
)


def attention_rows(seq_len: int, window: int | None, layer: dict, args) -> list[AttentionRow]:
    """Each kernel of :data:`ATTENTION_KERNELS` on one layer's causal (or windowed) attention."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from theseus.model.attention import AttentionMask, attention
    from theseus.model.kernels import cudnn_refusal, splash_refusal

    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(seq_len), 4)
    q = jax.random.normal(keys[0], (1, seq_len, layer["heads"], layer["head_dim"]), dtype)
    k, v = (
        jax.random.normal(key, (1, seq_len, layer["kv_heads"], layer["head_dim"]), dtype)
        for key in keys[1:3]
    )
    weights = jax.random.normal(keys[3], q.shape, dtype)  # (1, seq, heads, head_dim)
    mask = dataclasses.replace(AttentionMask.causal(seq_len), window=window)
    rows, results = [], {}
    refusals = {"cudnn": cudnn_refusal, "splash": splash_refusal}
    for kernel in ATTENTION_KERNELS:
        refusal = (
            refusals[kernel](q, mask, softcap=None, windows=()) if kernel in refusals else None
        )
        if refusal is not None:
            rows.append(AttentionRow(seq_len, window, kernel, refusal=refusal))
            continue

        def step(q, k, v, kernel=kernel):
            out, pullback = jax.vjp(lambda *qkv: attention(*qkv, mask, kernel=kernel), q, k, v)
            return (out, *pullback(weights))

        compiled = jax.jit(step).lower(q, k, v).compile()
        results[kernel] = jax.block_until_ready(compiled(q, k, v))  # warm-up
        start = time.perf_counter()
        for _ in range(args.steps):
            out = compiled(q, k, v)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - start) / args.steps
        temp = compiled.memory_analysis().temp_size_in_bytes
        rows.append(AttentionRow(seq_len, window, kernel, seconds, temp))
    want = results["xla"]
    for i, row in enumerate(rows):
        if row.kernel in results:
            got = results[row.kernel]
            difference = max(
                float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max())
                / float(jnp.abs(w.astype(jnp.float32)).max())
                for g, w in zip(got, want, strict=True)
            )
            rows[i] = dataclasses.replace(row, difference=difference)
    return rows


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
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS)
    )
    parser.add_argument(
        "--attention-seq-lens", default="2048,8192", help="comma-separated context lengths"
    )
    parser.add_argument("--attention-window", type=int, default=1024, help="sliding window")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if sorted(set(parts) - set(PARTS)):
        parser.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    seq_lens = [int(n) for n in args.attention_seq_lens.split(",")]
    layer = ATTENTION_LAYER
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
        seq_lens, args.attention_window, layer = [256], 37, DRY_RUN_ATTENTION_LAYER
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
    if "models" in parts:
        rows = []
        for model_name, hyper in models.items():
            for policy_name in fitting:
                rows.append(bench_one(model_name, hyper, policy_name, args, print))
        print()
        print(HEADER)
        for row in rows:
            print(row.render())
    if "attention" in parts:
        print(f"\nattention layer {layer}, {args.dtype}, forward + backward, {args.steps} calls")
        print(ATTENTION_HEADER)
        for seq_len in seq_lens:
            for window in (None, args.attention_window):
                rows = attention_rows(seq_len, window, layer, args)
                xla_s = next(row.step_s for row in rows if row.kernel == "xla")
                for row in rows:
                    print(row.render(xla_s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
