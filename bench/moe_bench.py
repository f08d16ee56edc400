"""One mixture-of-experts layer (64 experts, top 8) forward and backward: compiled FLOPs and
temporary bytes against what its active parameters need, and time, for theseus's dropless
grouped matmul (``jax.lax.ragged_dot_general``) and the one-hot dense formulation (every expert
on every token, weighted by a dense gate), side by side in one process.

    python bench/moe_bench.py [--tokens 2048] [--width 512] [--mlp 256] [--repeats 5]

The active-parameter FLOPs of forward + backward are 3 × 2 × tokens × top_k × 3 × width × mlp
(three matrices per expert, backward twice the forward). Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from theseus.model.experts import Experts, mixture
from theseus.model.parts import arrays


def one_hot_dense(block: Experts, h: jax.Array, activation) -> jax.Array:
    """Every expert on every token, weighted by the router's (zero outside the top k)."""
    logits = block.gate(h).astype(jnp.float32)  # (tokens, experts)
    probs = jax.nn.softmax(logits, axis=-1)
    top, chosen = jax.lax.top_k(probs, block.top_k)
    gates = jnp.einsum("tk,tke->te", top, jax.nn.one_hot(chosen, probs.shape[-1]))
    gate = jnp.einsum("td,eid->tei", h, block.gate_proj.weight)  # (tokens, experts, mlp)
    up = jnp.einsum("td,eid->tei", h, block.up_proj.weight)
    out = jnp.einsum("tei,edi->ted", activation(gate) * up, block.down_proj.weight)
    return jnp.einsum("ted,te->td", out, gates)  # (tokens, width)


def measure(name: str, layer, block: Experts, h: jax.Array, repeats: int, active: float) -> float:
    def loss(block, h):
        return jnp.sum(layer(block, h) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    compiled = step.lower(block, h).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops, temp = cost["flops"], compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(block, h))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(block, h))
        times.append(time.perf_counter() - start)
    best = min(times)
    print(
        f"{name:>14}: {flops:.3e} FLOPs ({flops / active:.2f}× active), temp "
        f"{temp / 2**20:.1f} MiB, {best * 1e3:.1f} ms"
    )
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--mlp", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dims = (1, args.experts, args.width, args.mlp, args.top_k, True, nnx.Rngs(0))
    block = jax.tree.map(lambda a: a[0], arrays(Experts.create(*dims)))
    h = jax.random.normal(jax.random.key(1), (1, args.tokens, args.width))
    active = 3 * 2 * args.tokens * args.top_k * 3 * args.width * args.mlp
    print(
        f"{jax.devices()[0].platform}: {args.experts} experts, top {args.top_k}, {args.tokens} tokens"
    )
    grouped = measure(
        "grouped", lambda b, x: mixture(b, x, jax.nn.silu)[0], block, h, args.repeats, active
    )
    dense = measure(
        "one-hot dense",
        lambda b, x: one_hot_dense(b, x[0], jax.nn.silu),
        block,
        h,
        args.repeats,
        active,
    )
    print(f"time grouped / one-hot dense: {grouped / dense:.2f}")


if __name__ == "__main__":
    main()
