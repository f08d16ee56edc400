"""The token exchange of experts placed on the mesh (``--experts shard|batch|both``): each device
runs the experts it stores on the tokens that chose them, and no expert weight moves.

Inside a ``shard_map`` manual over ``batch`` and the axes the experts are split over, each device
holds its replica's tokens (split over ``batch``) and its share of the experts. Over ``batch``
(:func:`theseus.sharding.axis.token_exchange`: ``all-to-all``), it sends every device along
``batch`` (same ``shard`` index) its tokens with, per token, the choices that device's experts
own (their local indices and router weights; the other choices weight 0), by one all-to-all over
``batch``; runs its experts on what it received (:func:`theseus.model.experts.dropless`:
sorted by expert, grouped matmuls); and sends each token's weighted sum over its experts back by
the reverse all-to-all, where the sums of all destinations add up to the token's output. With
experts over ``shard`` (alone: ``all-reduce``, or ``both``), a device handles the choices of its
``shard`` group's experts and the groups' sums are added over ``shard``.

The buffers have static shapes: a destination may own every choice of every token, so each
device sends each destination a slot for every token (dropless: nothing can be dropped). The
bytes are those of an all-gather of the tokens over ``batch`` and a reduce-scatter of the
outputs, without gathering any expert weight; the rows each device multiplies are sized for the
worst case too: ``min(top_k, its experts)`` per token it receives. Capacity (``expert_capacity``) is
decided before the exchange, on the whole microbatch's routing, as on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from theseus.model.parts import Projection
from theseus.sharding.axis import EXPERT_AXES, Axis, Placement

#: The gate, up and down projections of an expert block, each (experts, d_out, d_in).
Projections = tuple[Projection, Projection, Projection]
#: ``local(projections, tokens, chosen, weights)``: the experts of ``projections`` on ``tokens``
#: (n, n_embd) for the choices ``chosen`` int32 (n, top_k) into them, weighted by ``weights``
#: (n, top_k).
Local = Callable[[Projections, jax.Array, jax.Array, jax.Array], jax.Array]


def destinations(
    chosen: jax.Array, weights: jax.Array, group_experts: int, devices: int, group: jax.Array | int
) -> tuple[jax.Array, jax.Array]:
    """Which choices each of ``devices`` destinations (along ``batch``) owns, of the choices
    ``chosen`` int32 (tokens, top_k) and their router ``weights`` (tokens, top_k): experts come
    in ``shard`` groups of ``group_experts`` (every expert when they are over ``batch`` only),
    this device's ``group`` split evenly over the destinations in order. Per token and
    destination, ``slots = min(top_k, experts per destination)`` choices (a token chooses an
    expert once, so a destination owns at most that many of them): the local expert index int32
    and weight of each owned choice, 0 and weight 0 in unused slots; both (devices, tokens,
    slots)."""
    per_device = group_experts // devices
    slots = min(chosen.shape[-1], per_device)
    within = chosen - group * group_experts  # (tokens, top_k): index in this group
    owner = jnp.where((within >= 0) & (within < group_experts), within // per_device, -1)
    owned = owner[None] == jnp.arange(devices)[:, None, None]  # (devices, tokens, top_k)
    first = jnp.argsort(~owned, axis=-1, stable=True)[..., :slots]  # owned choices first

    def pick(a: jax.Array) -> jax.Array:  # (tokens, top_k) -> (devices, tokens, slots)
        return jnp.take_along_axis(jnp.broadcast_to(a, owned.shape), first, axis=-1)

    mask = pick(owned)
    local = jnp.where(mask, pick(within % per_device), 0).astype(jnp.int32)
    return local, jnp.where(mask, pick(weights), 0).astype(weights.dtype)


def exchanged(
    local: Local,
    experts: Projections,
    tokens: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    placement: Placement,
) -> jax.Array:
    """The ``experts``' weighted output for ``tokens`` (tokens, n_embd), split over ``batch``,
    with their choices ``chosen`` int32 (tokens, top_k) and router ``weights`` (tokens, top_k),
    the experts split over the axes of ``placement``: (tokens, n_embd) in ``tokens``' dtype,
    split as ``tokens``. ``local`` runs a device's own experts on what it received."""
    axes = EXPERT_AXES[placement]
    mesh = jax.sharding.get_abstract_mesh()
    # Inside the step's shard_map over batch (replicas accumulating on their own: experts not
    # over batch) the tokens are already the replica's.
    manual = {Axis.BATCH, *axes} - set(mesh.manual_axes)
    assert axes and set(axes) <= manual <= set(mesh.axis_names)
    num_experts = experts[0].weight.shape[0]
    groups = mesh.shape[Axis.SHARD] if Axis.SHARD in axes else 1
    devices = mesh.shape[Axis.BATCH] if Axis.BATCH in axes else 1
    expert_spec = P(axes[0] if len(axes) == 1 else axes)

    def exchange(a: jax.Array) -> jax.Array:  # (devices, ...): [destination] -> [source]
        return jax.lax.all_to_all(a, Axis.BATCH, 0, 0, tiled=True) if devices > 1 else a

    def run(x, chosen, weights, experts):  # x (tokens / replicas, n_embd): this replica's
        group = jax.lax.axis_index(Axis.SHARD) if groups > 1 else 0
        owned, owned_weights = destinations(chosen, weights, num_experts // groups, devices, group)
        sent = jnp.broadcast_to(x[None], (devices, *x.shape))  # (devices, tokens, n_embd)
        x, owned, owned_weights = (exchange(a) for a in (sent, owned, owned_weights))
        slots = owned.shape[-1]
        out = local(experts, x.reshape(-1, x.shape[-1]), owned.reshape(-1, slots),
                    owned_weights.reshape(-1, slots))  # fmt: skip
        out = exchange(out.reshape(x.shape)).sum(0)  # (tokens, n_embd): every source's sums
        return jax.lax.psum(out, Axis.SHARD) if groups > 1 else out

    rows = P(Axis.BATCH if Axis.BATCH in manual else None)
    return jax.shard_map(
        run,
        in_specs=(rows, rows, rows, jax.tree.map(lambda _: expert_spec, experts)),
        out_specs=rows,
        axis_names=manual,
        check_vma=False,
    )(tokens, chosen, weights, experts)
