"""The plan's activation estimate against the compiled step's temporaries (issue #36: within 15%
for GPT and Llama at 2,048 and 32,768 tokens, one device and tp=2 + FSDP): 2-layer decoders with
realistic heads (GPT 256 wide, 4 heads of 64; Llama 512 wide, 4 heads of 128, 2 kv heads), a
vocabulary of 520 (or ``--vocab``: 32,000 puts the loss in 16 chunks at 32,768 tokens), one
example per device, bfloat16 compute, the model's default attention (blockwise on CPU), on one
device and under tp=2 + FSDP (4 simulated devices), per recompute policy and sequence length.

    PYTHONPATH=. python bench/activation_bench.py [--lengths 2048,32768] [--layers 2]
        [--remat none,full,dots] [--families gpt,llama] [--vocab 520]

Compile only (``memory_analysis()`` allocates nothing); prints one row per step: the compiled
temp bytes, the plan's ``activation_bytes``, their ratio and the terms the plan names as not
predicted (``ActivationMemory.unpredicted``). Asserts nothing (the tests do).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

MODELS = {
    "gpt": ["model.n_head=4", "model.n_embd=256"],  # head dim 64
    "llama": [
        "model.hidden_size=512",
        "model.num_heads=4",  # head dim 128
        "model.num_kv_heads=2",
        "model.intermediate_size=1376",
    ],
}
CONTEXT_KEY = {"gpt": "model.block_size", "llama": "model.max_position_embeddings"}
LAYERS_KEY = {"gpt": "model.n_layer", "llama": "model.num_layers"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,32768")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--remat", default="none,full,dots")
    parser.add_argument("--families", default="gpt,llama")
    parser.add_argument(
        "--vocab",
        type=int,
        default=520,
        help="vocabulary size (32000: the loss takes chunks of 2,048 positions at 32,768 tokens)",
    )
    args = parser.parse_args()

    import theseus.plan as planner
    from theseus.config import apply_overrides
    from theseus.jobs import families
    from theseus.sharding.axis import ShardingPolicy

    registry = families()
    layouts = {"one device": (1, {"zero": False}), "tp=2 + FSDP": (4, {"tp": 2, "fsdp": True})}
    print(
        "| family | vocab | layout | recompute | tokens | loss chunk | temp bytes | "
        "activation_bytes | ratio | not predicted | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    grid = itertools.product(
        args.families.split(","),
        layouts.items(),
        args.remat.split(","),
        [int(n) for n in args.lengths.split(",")],
    )
    for family, (layout, (devices, policy)), remat, length in grid:
        trainer_class = registry[family].trainer_class
        replicas = devices // policy.get("tp", 1)
        config = apply_overrides(
            trainer_class.config_class(),
            [
                *MODELS[family],
                f"model.vocab_size={args.vocab}",
                f"{LAYERS_KEY[family]}={args.layers}",
                f"{CONTEXT_KEY[family]}={length}",
                f"training.seq_len={length}",
                f"training.batch_size={replicas}",
                "training.per_device_batch_size=1",
                "training.dtype=bfloat16",
            ],
        )
        start = time.perf_counter()
        plan = planner.plan(
            trainer_class,
            config,
            ShardingPolicy(activation_checkpointing=remat, **policy),
            devices,
            compile=True,
            alternatives=False,
            compare_remat=False,
        )
        assert plan.compiled is not None and plan.activations is not None  # compiled decoders
        temp, estimate = plan.compiled.temporaries, plan.activation_bytes
        seconds = time.perf_counter() - start
        print(
            f"| {family} | {args.vocab:,} | {layout} | {remat} | {length:,} | "
            f"{plan.activations.loss_chunk:,} | {temp:,} | {estimate:,} | "
            f"{estimate / temp:.3f} | {plan.activations.unpredicted or ''} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
