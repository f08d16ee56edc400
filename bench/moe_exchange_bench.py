"""The token exchange of one mixture-of-experts layer (forward and backward) on 8 simulated
devices: compiled collective bytes per device (:mod:`theseus.accounting.collectives`), FLOPs and
temporaries, for experts over ``batch``, ``shard`` (tp=8) and both (tp=2), each with the exchange
theseus runs (:func:`theseus.sharding.axis.token_exchange`) and left to XLA's partitioner (what
it ran before).

    python bench/moe_exchange_bench.py [--tokens 4096] [--width 256] [--mlp 128]

No timing: the simulated devices share one CPU. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.accounting.collectives import count_collectives
from theseus.model.experts import Experts, mixture
from theseus.model.parts import arrays
from theseus.sharding.axis import EXPERT_AXES, Placement
from theseus.sharding.layer_scan import LayerLayouts, layer_layouts

CASES: tuple[tuple[str, int, Placement, Placement], ...] = (
    # (name, tp, where the weights are, the placement the layer is told: "none" is XLA's
    # partitioning of the same weights, what theseus ran before the exchange)
    ("batch, all-to-all", 1, "batch", "batch"),
    ("batch, XLA-partitioned", 1, "batch", "none"),
    ("shard (tp=8), all-reduce", 8, "shard", "shard"),
    ("shard (tp=8), XLA-partitioned", 8, "shard", "none"),
    ("both (tp=2), all-to-all", 2, "both", "both"),
    ("both (tp=2), XLA-partitioned", 2, "both", "none"),
)


def measure(block: Experts, h: jax.Array, tp: int, stored: Placement, told: Placement) -> str:
    mesh = jax.make_mesh((8 // tp, tp), ("batch", "shard"), axis_types=(AxisType.Auto,) * 2)
    experts = EXPERT_AXES[stored]

    def put(a: jax.Array) -> jax.Array:
        spec = P(experts[0] if len(experts) == 1 else experts) if a.ndim == 3 else P()
        return jax.device_put(a, NamedSharding(mesh, spec))

    def loss(b: Experts, h: jax.Array) -> jax.Array:
        return jnp.sum(mixture(b, h, jax.nn.silu)[0].astype(jnp.float32) ** 2)

    tokens = jax.device_put(h, NamedSharding(mesh, P("batch")))
    with jax.set_mesh(mesh), layer_layouts(LayerLayouts({}, {}, experts=told)):
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        compiled = step.lower(jax.tree.map(put, block), tokens).compile()
    collectives = count_collectives(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    temp = compiled.memory_analysis().temp_size_in_bytes
    kinds = ", ".join(
        f"{op} {collectives[op].bytes / 2**20:.1f}" for op in collectives if collectives[op].count
    )
    return (
        f"{collectives.bytes / 2**20:.1f} MiB ({kinds}); {cost['flops']:.3e} FLOPs; "
        f"temp {temp / 2**20:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--mlp", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    dims = (1, args.experts, args.width, args.mlp, args.top_k, True, nnx.Rngs(0))
    block = jax.tree.map(lambda a: a[0], arrays(Experts.create(*dims)))
    h = jax.random.normal(jax.random.key(1), (8, args.tokens // 8, args.width), jnp.bfloat16)
    print(
        f"{args.experts} experts, top {args.top_k}, {args.tokens} tokens × {args.width} "
        f"(bfloat16), expert width {args.mlp}, 8 devices; per device per step:"
    )
    for name, tp, stored, told in CASES:
        print(f"{name:>30}: {measure(block, h, tp, stored, told)}")


if __name__ == "__main__":
    main()
