"""The plan's rollout of an RL job against the compiled generation programs: for each case, a
2-layer Llama's prefill and decode step compiled for its generation batch on 8 simulated devices
(compile only: ``memory_analysis()`` allocates nothing) beside the plan's KV cache and
temporaries (:mod:`theseus.plan.rollout`).

    PYTHONPATH=. python bench/rollout_bench.py

Prints one row per case: the compiled prefill and decode temp bytes and the plan's, and the
generation beyond the state (the larger program's peak less the parameters it shares with the
state) against the plan's. Asserts nothing (tests/test_rl_plan.py does).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

COMMON = [
    "model.num_layers=2",
    "model.vocab_size=264",
    "model.max_position_embeddings=1024",
    "model.num_kv_heads=2",
    "rl.num_generations=4",
    "training.per_device_batch_size=1",
    "training.seq_len=512",
    "rl.max_completion_length=128",
    "training.dtype=bfloat16",
    "training.batch_size=16",
]
SMALL = ["model.hidden_size=48", "model.num_heads=4", "model.intermediate_size=136"]
WIDE = ["model.hidden_size=256", "model.num_heads=4", "model.intermediate_size=1024"]
WIDER = [
    "model.hidden_size=512",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.intermediate_size=1408",
    "training.seq_len=256",
    "training.batch_size=32",
]
MODELS = {"48 wide": SMALL, "256 wide": WIDE, "512 wide": WIDER}
# (policy, overrides): later overrides win.
CASES = [
    ("ZeRO", [*SMALL]),
    ("ZeRO", [*SMALL, "training.batch_size=32"]),
    ("ZeRO", [*SMALL, "training.seq_len=1024", "rl.max_completion_length=256"]),
    ("ZeRO", [*SMALL, "training.dtype=float32"]),
    ("ZeRO", [*SMALL, "model.attention=xla"]),
    ("ZeRO", [*SMALL, "rl.max_completion_length=384"]),
    ("ZeRO", [*SMALL, "model.num_layers=6", "training.batch_size=64"]),
    ("FSDP tp=2", [*SMALL]),
    (
        "FSDP",
        [*SMALL, "training.batch_size=8", "rl.num_generations=2", "rl.steps_per_generation=64"],
    ),
    ("ZeRO", [*WIDE]),
    ("ZeRO", [*WIDE, "training.batch_size=64"]),
    ("ZeRO", [*WIDE, "training.batch_size=32", "model.vocab_size=8192"]),
    ("ZeRO", [*WIDE, "training.batch_size=32", "training.dtype=float32", "model.attention=xla"]),
    ("ZeRO", [*WIDER]),
    ("ZeRO", [*WIDER, "training.dtype=float32"]),
    ("FSDP tp=2", [*WIDER]),
]


def main() -> None:
    import jax

    import theseus.plan as planner
    from theseus.config import apply_overrides
    from theseus.jobs import get_job
    from theseus.plan.rollout import compile_rollout
    from theseus.sharding.axis import ShardingPolicy
    from theseus.sharding.layout import shard_shape
    from theseus.sharding.topology import Topology

    policies = {
        "ZeRO": ShardingPolicy(),
        "FSDP": ShardingPolicy(fsdp=True),
        "FSDP tp=2": ShardingPolicy(tp=2, fsdp=True),
    }
    trainer_class = get_job("llama/train/rl").trainer_class
    header = "| case | rows/device | prefill temp | plan | decode temp | plan | generation | plan |"
    print(header)
    print("|---" * 8 + "|")
    for name, overrides in CASES:
        policy = policies[name]
        config = apply_overrides(trainer_class.config_class(), [*COMMON, *overrides])
        plan = planner.plan(trainer_class, config, policy, 8, alternatives=False)
        trainer = trainer_class(config, policy, Topology.new(policy, devices=jax.devices()))
        compiled = compile_rollout(trainer)
        rollout = plan.rollout
        assert rollout is not None
        layout = jax.tree.leaves(trainer.layouts.compute)
        compute = sum(  # the parameters as the generation reads them
            math.prod(shard_shape(leaf.shape, sharding.spec, plan.mesh_shape)) * leaf.dtype.itemsize
            for leaf, sharding in zip(trainer.abstract_leaves, layout, strict=True)
        )
        measured = compiled.peak - (compute - rollout.gathered)
        estimate = rollout.generation - rollout.tokens
        model, base = next((m, b) for m, b in MODELS.items() if b[0] in overrides)
        changes = [o.split(".", 1)[1] for o in overrides if o not in base]
        cells = [
            ", ".join([model, name, *changes]),
            f"{rollout.rows_per_device}",
            f"{compiled.prefill.temporaries:,}",
            f"{rollout.prefill:,} ({rollout.prefill / compiled.prefill.temporaries:.2f})",
            f"{compiled.decode.temporaries:,}",
            f"{rollout.decode:,} ({rollout.decode / compiled.decode.temporaries:.2f})",
            f"{measured:,}",
            f"{estimate:,} ({estimate / measured:.2f})",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
