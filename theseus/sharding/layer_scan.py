"""Per-layer gathering: a layer scan that moves each layer's weights to the compute layout just
before the layer runs, in the compute dtype, and chooses what the backward pass recomputes.

A model whose layers are stacked along a leading ``n_layer`` dimension runs them with
:func:`scan_layers` instead of ``jax.lax.scan``. Alone (outside a trainer, or on one device) it is
a plain scan. Inside a trainer's loss, the trainer has installed the parameter layouts
(:func:`layer_layouts`); then, inside the scan body, each layer's slice is constrained first to
its storage layout and then to its compute layout. Under FSDP that is a gather over ``batch`` of
one layer at a time, and each layer's gradient leaves the body reduced back to the storage layout
(a reduce-scatter), whole model never gathered.

- **Gather in the compute dtype.** When the trainer installs a lower ``cast_dtype`` (bfloat16
  compute, ``training.gather_dtype=compute``), a weight the layer only reads through a cast to
  that dtype (:mod:`theseus.sharding.casting`: the matrices of :func:`~theseus.model.layers.dense`)
  is cast on each device before the gather, so the gather moves half the bytes and the layer
  reads the same values. The gradient path stays float32: the gather's own VJP reduces the
  float32 weight gradient back to the storage layout.
- **Reshard after forward.** A gathered weight is named :data:`GATHERED`, and whenever weights
  are gathered the scan body is checkpointed with a policy that never saves them: the backward
  pass keeps only the stored shard and gathers it again (FSDP's "reshard after forward").
- **What to recompute** (``remat``, :data:`REMAT_POLICIES`): ``none`` keeps every activation for
  the backward pass; ``full`` recomputes each whole layer (activation checkpointing); ``dots``
  keeps the outputs of matmuls without batch dimensions (the weight projections) and recomputes
  the rest (attention scores, norms, activations).

A model that does not use it still trains correctly: the trainer then moves every parameter to
the compute layout before the loss, all at once, and ``theseus plan`` says what that costs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from theseus.sharding.axis import REMAT_POLICIES, Placement, Remat, remat_policy
from theseus.sharding.casting import cast_only_inputs

#: The ``checkpoint_name`` of every weight gathered inside the layer scan.
GATHERED = "theseus_gathered_weight"
#: The ``checkpoint_name`` of a weight matmul's output (:func:`theseus.model.layers.dense`),
#: which the ``dots`` policy keeps.
MATMUL = "theseus_matmul"


@dataclass(frozen=True)
class LayerLayouts:
    """What the trainer installs around its loss: the storage and compute sharding of every
    parameter array, keyed by the ``id`` of the traced array the model receives; the dtype to
    gather castable weights in (None: their storage dtype); the policy's recompute setting
    (used when :func:`scan_layers` is not given one); where the policy places a mixture's
    experts (:func:`expert_placement`); and the set into which :func:`scan_layers` records the
    ids of the arrays it gathered per layer."""

    storage: Mapping[int, NamedSharding]
    compute: Mapping[int, NamedSharding]
    cast_dtype: np.dtype | None = None
    remat: Remat = "none"
    experts: Placement = "none"
    gathered: set[int] = field(default_factory=set)


_ACTIVE: contextvars.ContextVar[LayerLayouts | None] = contextvars.ContextVar(
    "theseus_layer_layouts", default=None
)


#: While a layer runs inside the scan: each gathered weight's id -> (the weight, its stored
#: shard, its move), so a matmul with its own VJP can keep the shard instead (gathered_source).
_SOURCES: contextvars.ContextVar[dict[int, tuple] | None] = contextvars.ContextVar(
    "theseus_gathered_sources", default=None
)


def gathered_source(weight: jax.Array) -> tuple[jax.Array, Any] | None:
    """``(stored shard, move)`` when ``weight`` is a weight :func:`scan_layers` gathered for
    the running layer, else None. A matmul with a custom VJP (:func:`theseus.model.layers.dense`)
    uses it to save the stored shard for its backward pass and gather again there, since JAX
    saves a custom VJP's residuals whatever the remat policy says; the move is applied with
    :func:`move_to_compute` and the weight gradient returned by :func:`reduce_to_storage`."""
    sources = _SOURCES.get()
    entry = None if sources is None else sources.get(id(weight))
    if entry is None or entry[0] is not weight:
        return None
    return entry[1], entry[2]


def expert_placement() -> Placement:
    """Where the trainer's policy places a mixture's experts (``ShardingPolicy.experts``):
    ``"none"`` outside a trainer's loss, where nothing is placed."""
    active = _ACTIVE.get()
    return "none" if active is None else active.experts


@contextlib.contextmanager
def layer_layouts(layouts: LayerLayouts) -> Iterator[LayerLayouts]:
    """Install ``layouts`` for the :func:`scan_layers` calls traced inside the block."""
    token = _ACTIVE.set(layouts)
    try:
        yield layouts
    finally:
        _ACTIVE.reset(token)


@dataclass(frozen=True)
class Move:
    """How one layer's slice of a parameter reaches the compute layout: its storage and compute
    sharding, and the dtype it travels in (None: its own)."""

    storage: NamedSharding
    compute: NamedSharding
    dtype: np.dtype | None


def _slice(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked array: its spec without the leading dimension."""
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


def _moves(leaves: list, layouts: LayerLayouts) -> list[Move | None]:
    """Per leaf, the move of one layer when it is a parameter array the trainer knows whose
    layouts differ, else None (nothing to gather). The dtype is left unset here."""
    moves: list[Move | None] = []
    for leaf in leaves:
        if id(leaf) not in layouts.compute:
            moves.append(None)
            continue
        layouts.gathered.add(id(leaf))
        storage, compute = layouts.storage[id(leaf)], layouts.compute[id(leaf)]
        same = storage.spec == compute.spec  # nothing to move (no FSDP): leave XLA free
        moves.append(None if same else Move(_slice(storage), _slice(compute), None))
    return moves


def _with_dtypes(moves, layer_fn, carry, leaves, treedef, cast_dtype) -> list[Move | None]:
    """``moves`` with the compute dtype set on those the layer reads only through a cast to
    it (and whose own dtype is wider)."""
    if cast_dtype is None:
        return moves
    wider = [
        m is not None and np.dtype(leaf.dtype).itemsize > np.dtype(cast_dtype).itemsize
        for m, leaf in zip(moves, leaves, strict=True)
    ]
    if not any(wider):
        return moves
    one_layer = [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype) for leaf in leaves]

    def layer(flat, carry):
        return layer_fn(treedef.unflatten(flat), carry)

    which = [*wider, *[False] * len(jax.tree.leaves(carry))]
    castable = cast_only_inputs(layer, (one_layer, carry), cast_dtype, which)
    return [
        Move(m.storage, m.compute, np.dtype(cast_dtype)) if cast else m
        for m, cast in zip(moves, castable, strict=False)
    ]


def _named(x: jax.Array) -> jax.Array:
    return checkpoint_name(x, GATHERED)


def move_to_compute(leaf: jax.Array, move: Move) -> jax.Array:
    """One layer's weight moved from storage to the compute layout; with ``move.dtype``, each
    device casts its shard first and the gathered values come back in the leaf's dtype (the
    layer casts them again, exactly). Differentiating it directly would reduce the gradient in
    ``move.dtype``: use it inside a custom VJP (:func:`_gather`, or a matmul's own).

    The cast shard travels as its bit pattern (an unsigned integer of the same width): the same
    bytes, which no backend widens again (XLA:CPU's float normalization turns a bfloat16
    all-gather into a float32 one). Every value on the way is named :data:`GATHERED`: a remat
    policy that does not save that name then saves none of them and recomputes the move from
    the stored shard (naming only the result would save its unnamed input instead)."""
    constrain = jax.lax.with_sharding_constraint
    stored = _named(constrain(_named(leaf), move.storage))
    if move.dtype is None:
        return _named(constrain(stored, move.compute))
    bits_dtype = np.dtype(f"uint{8 * move.dtype.itemsize}")
    narrow = _named(stored.astype(move.dtype))  # cast on each device's own shard
    bits = _named(constrain(_named(jax.lax.bitcast_convert_type(narrow, bits_dtype)), move.storage))
    bits = _named(constrain(bits, move.compute))  # the gather, move.dtype's bytes
    narrow = _named(jax.lax.bitcast_convert_type(bits, move.dtype))
    return _named(constrain(_named(narrow.astype(leaf.dtype)), move.compute))


def reduce_to_storage(grad: jax.Array, move: Move) -> jax.Array:
    """A weight gradient in the compute layout back to the storage layout, in its own (float32)
    dtype: a reduce-scatter under FSDP, never through the transpose of the cast."""
    return jax.lax.with_sharding_constraint(grad, move.storage)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(leaf: jax.Array, move: Move) -> jax.Array:
    """:func:`move_to_compute` whose gradient goes back by :func:`reduce_to_storage`."""
    return move_to_compute(leaf, move)


def _gather_fwd(leaf: jax.Array, move: Move):
    return _gather(leaf, move), None


def _gather_bwd(move: Move, _, grad: jax.Array):
    return (reduce_to_storage(grad, move),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _checkpointed(body: Callable, remat: Remat, gathers: bool) -> Callable:
    """``body`` with the recompute ``remat`` asks for; when it gathers weights, never saving
    them for the backward pass (reshard after forward)."""
    if remat == "full":
        return jax.checkpoint(body)  # the gather is recomputed with the layer
    if remat == "dots":
        policies = jax.checkpoint_policies
        keep = policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(MATMUL)
        )
        return jax.checkpoint(body, policy=keep)
    if gathers:
        return jax.checkpoint(
            body, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED)
        )
    return body


def scan_layers(
    layer_fn: Callable[[Any, Any], Any],
    carry: Any,
    layers: Any,
    *,
    remat: bool | str | None = None,  # checked by remat_policy
) -> Any:
    """``carry = layer_fn(layer, carry)`` for each layer of ``layers``; returns the last carry.

    ``layers``: the stacked parameters, a pytree of arrays (or an ``nnx.Module``/``nnx.State``
    holding them) whose leaves all have the layer count as their leading dimension; ``layer``
    is the same pytree with that dimension removed. ``remat``: what the backward pass recomputes
    per layer, one of :data:`REMAT_POLICIES` (``True`` is ``"full"``, ``False`` ``"none"``);
    None takes the trainer's policy (``activation_checkpointing``), or ``"none"`` outside a
    trainer. Under a trainer, each layer's weights are gathered to the compute layout inside the
    scan body, in the compute dtype where the layer only reads them cast to it.
    """
    if isinstance(layers, nnx.Module):
        layers = nnx.state(layers)
    if isinstance(layers, nnx.State):
        layers = nnx.to_pure_dict(layers)
    leaves, treedef = jax.tree.flatten(layers)
    active = _ACTIVE.get()
    remat = remat_policy(active.remat if remat is None and active is not None else remat)
    moves: list[Move | None] = [None] * len(leaves)
    if active is not None:
        moves = _moves(leaves, active)
        moves = _with_dtypes(moves, layer_fn, carry, leaves, treedef, active.cast_dtype)

    def body(carry, layer):
        # jaxlib's stubs leave PyTreeDef.flatten_up_to out; it exists (jax 0.4 and on).
        stored = treedef.flatten_up_to(layer)  # type: ignore[attr-defined]
        flat = [x if m is None else _gather(x, m) for x, m in zip(stored, moves, strict=True)]
        sources = {  # under full recompute the gathered weight is recomputed anyway
            id(w): (w, x, m)
            for w, x, m in zip(flat, stored, moves, strict=True)
            if m is not None and remat != "full"
        }
        token = _SOURCES.set(sources)
        try:
            return layer_fn(jax.tree.unflatten(treedef, flat), carry), None
        finally:
            _SOURCES.reset(token)

    body = _checkpointed(body, remat, any(m is not None for m in moves))
    carry, _ = jax.lax.scan(body, carry, layers)
    return carry


__all__ = [
    "GATHERED",
    "MATMUL",
    "REMAT_POLICIES",
    "LayerLayouts",
    "Move",
    "gathered_source",
    "layer_layouts",
    "move_to_compute",
    "reduce_to_storage",
    "scan_layers",
]
