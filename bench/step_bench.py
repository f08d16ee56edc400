"""Step time of theseus's GPT train step against the hand-written plain-JAX step of
``bench/reference.py`` (same model math, same layouts), per policy, on 8 simulated CPU devices.

    python bench/step_bench.py [--repeats 7] [--steps 4] [--policies DP,ZeRO,...] [--control]

Both steps start from the same parameters; their first losses must agree (to 1e-5), which shows
they compute the same thing. Timing: after a warm-up, each repetition runs ``--steps`` steps of
every (policy, implementation) pair, in an order that alternates which implementation goes first,
blocking only at the end of each run. Each repetition gives one ratio theseus / hand-written from
two runs back to back, so both see the same load on a shared machine; the table shows the median
seconds per step of each, the median of those paired ratios (with their range), and the same
median ratio of the process's CPU time per step, which depends less on how other jobs on the
machine delay the 8 device threads. Simulated devices share the host's cores: the ratio shows
framework overhead, not speedup. ``--control`` adds a second copy of the hand-written step and
its paired ratio to the first: the same program, so it shows how far from 1 noise alone moves a
ratio (this is how theseus's 6% FSDP overhead was shown to be real). Prints a table; asserts only
the loss agreement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import jax  # noqa: E402 - after the device count is set
import numpy as np  # noqa: E402
import reference  # noqa: E402

# name: (tp, zero, fsdp)
POLICIES = {
    "DP": (1, False, False),
    "ZeRO": (1, True, False),
    "FSDP": (1, True, True),
    "tp=2": (2, True, False),
    "tp=2+FSDP": (2, True, True),
    "tp=4+FSDP": (4, True, True),
}
# Enough work per step that a step is tens of milliseconds on 2 cores, small enough to compile
# ten steps in well under a minute.
MODEL = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
BATCH = {"batch_size": 32, "per_device_batch_size": 2}


@dataclass
class Contender:
    name: str
    step: object  # (state, batch) -> (state, metrics)
    state: object
    batch: jax.Array
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)


def theseus_contender(policy_name: str, dtype: str):
    from theseus.config import apply_overrides
    from theseus.jobs import get_job
    from theseus.sharding.axis import ShardingPolicy

    GPTTrainer = get_job("gpt/train/pretrain").trainer_class
    GPTTrainerConfig = GPTTrainer.config_class

    tp, zero, fsdp = POLICIES[policy_name]
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()]
    overrides += [f"training.{k}={v}" for k, v in BATCH.items()] + [f"training.dtype={dtype}"]
    config = apply_overrides(GPTTrainerConfig(), overrides)
    trainer = GPTTrainer(config, ShardingPolicy(tp=tp, zero=zero, fsdp=fsdp))
    shape = trainer.batch_plan.shape
    tokens = np.random.default_rng(0).integers(0, MODEL["vocab_size"], shape, dtype=np.int32)
    batch = jax.device_put(tokens, trainer.batch_sharding)
    return trainer, trainer.compile().executable, trainer.init_state(), batch, tokens


def reference_contender(policy_name: str, dtype: str, params, tokens, per_layer_gather: bool):
    tp, zero, fsdp = POLICIES[policy_name]
    model = reference.Model(**MODEL, compute_dtype=jax.numpy.dtype(dtype))
    ref = reference.build(model, reference.Sharding(tp, zero, fsdp, per_layer_gather))
    state = ref.init(params)
    batch = jax.device_put(tokens, ref.batch_sharding)
    return ref.run, state, batch


def run(contender: Contender, steps: int) -> None:
    """Run ``steps`` steps; record wall and CPU seconds per step."""
    start, cpu_start = time.perf_counter(), time.process_time()
    state, metrics = contender.state, None
    for _ in range(steps):
        state, metrics = contender.step(state, contender.batch)
    jax.block_until_ready((state, metrics))
    contender.state = state
    contender.seconds.append((time.perf_counter() - start) / steps)
    contender.cpu_seconds.append((time.process_time() - cpu_start) / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed repetitions (median)")
    parser.add_argument("--steps", type=int, default=2, help="steps per timed repetition")
    parser.add_argument("--policies", default="DP,ZeRO,FSDP,tp=2,tp=2+FSDP")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--whole-tree-gather",
        action="store_true",
        help="the hand-written FSDP step gathers the whole tree before the loss (the simplest "
        "FSDP) instead of one layer at a time inside the scan as theseus does",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="also time a second copy of the hand-written step and show its ratio to the first: "
        "the noise floor of the ratios (same program, so ideally 1.000)",
    )
    args = parser.parse_args()
    names = args.policies.split(",")
    unknown = sorted(set(names) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")

    pairs = []
    for name in names:
        start = time.perf_counter()
        trainer, step, state, batch, tokens = theseus_contender(name, args.dtype)
        params = jax.tree.map(lambda a: a.copy(), state.params)  # the theseus step donates
        ref_step, ref_state, ref_batch = reference_contender(
            name, args.dtype, params, tokens, per_layer_gather=not args.whole_tree_gather
        )
        ours = Contender("theseus", step, state, batch)
        theirs = Contender("reference", ref_step, ref_state, ref_batch)
        contenders = [ours, theirs]
        if args.control:  # the same hand-written step again, from its own copy of the parameters
            copy = jax.tree.map(lambda a: a.copy(), params)
            control = reference_contender(
                name, args.dtype, copy, tokens, per_layer_gather=not args.whole_tree_gather
            )
            contenders.append(Contender("control", *control))
        losses = {}
        for contender in contenders:  # one warm-up step each; all must compute the same loss
            contender.state, metrics = contender.step(contender.state, contender.batch)
            losses[contender.name] = float(metrics["loss"])
        loss, ref_loss = losses["theseus"], losses["reference"]
        if max(losses.values()) - min(losses.values()) > 1e-5:
            raise SystemExit(f"{name}: the first losses differ: {losses}")
        print(
            f"{name}: mesh {dict(trainer.mesh.shape)}, {trainer.batch_plan.describe()}; "
            f"first loss {loss:.6f} (hand-written {ref_loss:.6f}); set up in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
        pairs.append((name, contenders))

    for repeat in range(args.repeats):
        for _, contenders in pairs:
            for contender in contenders if repeat % 2 == 0 else contenders[::-1]:
                run(contender, args.steps)

    model = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    print()
    print(
        f"GPT {model}, {BATCH['batch_size']} examples per step, {args.dtype}; 8 simulated CPU "
        f"devices; median of {args.repeats} × {args.steps} steps"
    )
    print(
        f"{'policy':<11} {'theseus s/step':>15} {'hand-written':>13} {'ratio':>7} {'range':>10}  "
        f"{'CPU-time ratio':>14}" + (f"  {'control ratio':>13}" if args.control else "")
    )
    for name, (ours, theirs, *control) in pairs:
        a, b = statistics.median(ours.seconds), statistics.median(theirs.seconds)
        ratios = paired_ratios(ours.seconds, theirs.seconds)
        cpu_ratio = statistics.median(paired_ratios(ours.cpu_seconds, theirs.cpu_seconds))
        noise = [statistics.median(paired_ratios(c.seconds, theirs.seconds)) for c in control]
        print(
            f"{name:<11} {a:>15.4f} {b:>13.4f} {statistics.median(ratios):>7.3f} "
            f"{min(ratios):>4.2f}-{max(ratios):<5.2f}  {cpu_ratio:>14.3f}"
            + "".join(f"  {n:>13.3f}" for n in noise)
        )


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    return [o / t for o, t in zip(ours, theirs, strict=True)]


if __name__ == "__main__":
    main()
