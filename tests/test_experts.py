"""The expert block alone: dropless experts on grouped matmuls against a dense reference (every
expert on every token, weighted), and the capacity setting: at experts / top_k nothing is dropped
and the output is dropless's; at 1.0 the choices beyond each expert's share are dropped, the
earliest tokens first, and counted; the token exchange of experts placed on the mesh equals one
device."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.accounting.collectives import count_collectives
from theseus.model.experts import (
    Experts,
    RouterSums,
    _blocked,
    _ragged,
    dropless,
    mixture,
    route,
    within_capacity,
)
from theseus.model.lora import delta
from theseus.model.parts import Lora, arrays
from theseus.sharding.axis import EXPERT_AXES, MESH_AXES
from theseus.sharding.layer_scan import LayerLayouts, layer_layouts

EXPERTS, TOP_K, WIDTH, MLP = 5, 2, 11, 7
# Compiled once each: run op by op, the blocks' gathers and scatters cost seconds apiece.
_mixture = jax.jit(mixture, static_argnums=2)
_route = jax.jit(route)
_dropless = jax.jit(dropless, static_argnums=4)
_within_capacity = jax.jit(within_capacity, static_argnums=(1, 2))


def _block(capacity=None) -> Experts:
    block = Experts.create(1, EXPERTS, WIDTH, MLP, TOP_K, True, nnx.Rngs(3), capacity)
    one = jax.tree.map(lambda a: a[0] * 20, arrays(block))  # one layer; routers far from even
    return one


def _tokens() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (3, 13, WIDTH))  # (batch, seq, n_embd)


def _dense(block: Experts, h: np.ndarray, weights: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """Each token's chosen experts' SwiGLU outputs, weighted, by loops (float64)."""
    gate, up, down = (
        np.asarray(w, np.float64)
        for w in (block.gate_proj.weight, block.up_proj.weight, block.down_proj.weight)
    )
    out = np.zeros(h.shape)
    for t in range(h.shape[0]):
        for k in range(TOP_K):
            e = experts[t, k]
            g, u = gate[e] @ h[t], up[e] @ h[t]
            out[t] += weights[t, k] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_dropless_equals_every_chosen_expert_computed_densely():
    block, h = _block(), _tokens()
    out, routing = _mixture(block, h, jax.nn.silu)
    flat = np.asarray(h, np.float64).reshape(-1, WIDTH)
    want = _dense(block, flat, np.asarray(routing.weights), np.asarray(routing.experts))
    np.testing.assert_allclose(np.asarray(out).reshape(-1, WIDTH), want, atol=1e-5)
    assert routing.kept is None


def test_capacity_of_experts_over_top_k_drops_nothing():
    h = _tokens()
    dropless_out, _ = _mixture(_block(), h, jax.nn.silu)
    out, routing = _mixture(_block(EXPERTS / TOP_K), h, jax.nn.silu)
    assert bool(routing.kept.all())
    np.testing.assert_allclose(out, dropless_out, atol=1e-6, rtol=0)
    sums = RouterSums.zeros(EXPERTS, 0.0).add(routing, None)
    assert float(sums.dropped) == 0.0


def _earliest_first(chosen: np.ndarray, num_experts: int) -> np.ndarray:
    """Which of the choices ``chosen`` (tokens, top_k) capacity 1.0 keeps: each expert's first
    ``ceil(tokens · top_k / experts)``, the earliest tokens first (a loop)."""
    limit = int(np.ceil(chosen.size / num_experts))
    taken = np.zeros(num_experts, int)
    kept = np.zeros(chosen.shape, bool)
    for t, row in enumerate(chosen):
        for k, e in enumerate(row):
            kept[t, k] = taken[e] < limit
            taken[e] += 1
    return kept


def test_capacity_one_drops_beyond_each_experts_share_and_counts_it():
    block, h = _block(1.0), _tokens()
    tokens = h.reshape(-1, WIDTH)
    routing = _within_capacity(_route(block, tokens), EXPERTS, 1.0)
    want_kept = _earliest_first(np.asarray(routing.experts), EXPERTS)  # 16 choices per expert
    np.testing.assert_array_equal(np.asarray(routing.kept), want_kept)
    assert 0 < (~want_kept).sum() < want_kept.size
    sums = RouterSums.zeros(EXPERTS, 0.0).add(routing, None)
    assert float(sums.dropped) == (~want_kept).sum()
    out = _dropless(block, tokens, routing.experts, routing.weights, jax.nn.silu)
    kept_weights = np.where(want_kept, np.asarray(_route(block, tokens).weights), 0.0)
    want = _dense(block, np.asarray(tokens, np.float64), kept_weights, np.asarray(routing.experts))
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_padded_blocks_equal_the_grouped_matmul():
    """CPU's blocked formulation and the grouped matmul other backends run (ragged_dot, exact
    on CPU too, densely) give the same rows, with an empty expert and groups of every size."""
    block, h = _block(), _tokens().reshape(-1, WIDTH)
    sizes = jnp.array([0, 1, 33, 2, 42], jnp.int32)  # 78 rows, one group above BLOCK_ROWS

    @jax.jit
    def rows_and_grads(block):
        def rows(b, f):
            return f(h[:78], b, sizes, jax.nn.silu)

        def grad(f):
            return jax.grad(lambda b: jnp.sum(rows(b, f) ** 2))(block)

        return [rows(block, f) for f in (_blocked, _ragged)], [grad(_blocked), grad(_ragged)]

    (blocked, ragged), grads = rows_and_grads(block)
    np.testing.assert_allclose(blocked, ragged, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        # Gradients of a sum of squares reach ~570 here: 1e-3 is 2e-6 of the largest (float32
        # sums in another order; measured 1.8e-4 at most).
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-5)


def test_expert_adapters_equal_their_merged_weights():
    """Per-expert LoRA factors, applied in the grouped products of both formulations, give
    what each expert's merged weight ``W + scale · b a`` gives."""
    block, h = _block(), _tokens().reshape(-1, WIDTH)[:20]
    sizes = jnp.array([3, 0, 9, 1, 7], jnp.int32)
    keys = iter(jax.random.split(jax.random.key(5), 6))
    adapted, merged = {}, {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = getattr(block, name)
        experts, d_out, d_in = proj.weight.shape
        a = jax.random.normal(next(keys), (experts, 3, d_in)) * 0.3  # (experts, rank, d_in)
        b = jax.random.normal(next(keys), (experts, d_out, 3)) * 0.3  # (experts, d_out, rank)
        lora = Lora(a=a, b=b, scale=0.5)
        adapted[name] = replace(proj, lora=lora)
        merged[name] = replace(proj, weight=proj.weight + lora.scale * delta(lora, "oi"))
    with_adapters, with_merged = replace(block, **adapted), replace(block, **merged)
    for formulation in (_blocked, _ragged):
        blocks = (with_adapters, with_merged, block)
        got, want, base = jax.jit(
            lambda bs, f=formulation: [f(h, b, sizes, jax.nn.silu) for b in bs]
        )(blocks)
        assert np.abs(got - base).max() > 1e-2
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_exchange_over_shard_and_batch_equals_one_device_with_capacity():
    """Eight experts over shard and batch (tp=2 × 4 replicas of 13 tokens): the all-to-all over
    batch and the sum over shard give the chosen experts' output, and capacity, decided over the
    whole batch before the exchange, drops the earliest-first choices of one device."""
    dims = (1, 8, WIDTH, MLP, TOP_K, True, nnx.Rngs(3), 1.0)
    block = jax.tree.map(lambda a: a[0] * 20, arrays(Experts.create(*dims)))
    h = jax.random.normal(jax.random.key(1), (4, 13, WIDTH))  # (batch, seq, n_embd)
    mesh = jax.make_mesh((4, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 2)
    split = {3: P(EXPERT_AXES["both"]), 2: P()}  # expert projections; the router whole
    placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, split[a.ndim])), block)
    rows = jax.device_put(h, NamedSharding(mesh, P(MESH_AXES[0])))
    with jax.set_mesh(mesh), layer_layouts(LayerLayouts({}, {}, experts="both")):
        step = jax.jit(mixture, static_argnums=2).lower(placed, rows, jax.nn.silu).compile()
    assert count_collectives(step.as_text())["all-to-all"].count > 0
    out, routing = step(placed, rows)
    chosen = np.asarray(routing.experts)
    kept = _earliest_first(chosen, 8)
    np.testing.assert_array_equal(routing.kept, kept)
    assert (~kept).sum() > 0
    want = _dense(block, np.asarray(h, np.float64).reshape(-1, WIDTH), routing.weights, chosen)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, WIDTH), want, atol=1e-5)
