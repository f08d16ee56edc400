"""Per-layer gathering: a layer scan that moves each layer's weights to the compute layout just
before the layer runs.

A model whose layers are stacked along a leading ``n_layer`` dimension runs them with
:func:`scan_layers` instead of ``jax.lax.scan``. Alone (outside a trainer, or on one device) it is
a plain scan. Inside a trainer's loss, the trainer has installed the parameter layouts
(:func:`layer_layouts`); then, inside the scan body, each layer's slice is constrained first to
its storage layout and then to its compute layout. Under FSDP that is a gather over ``batch`` of
one layer at a time, and each layer's gradient leaves the body reduced back to the storage layout
(a reduce-scatter). With ``remat=True`` (activation checkpointing) the gather is recomputed with
the layer in the backward pass, so the whole model is never gathered; without it, each layer's
gathered weights are kept for the backward pass like its activations (a gathered copy of every
layer: use activation checkpointing when the model must fit under FSDP).

A model that does not use it still trains correctly: the trainer then moves every parameter to
the compute layout before the loss, all at once, and ``theseus plan`` says what that costs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


@dataclass(frozen=True)
class LayerLayouts:
    """What the trainer installs around its loss: the storage and compute sharding of every
    parameter array, keyed by the ``id`` of the traced array the model receives, and the set
    into which :func:`scan_layers` records the ids of the arrays it gathered per layer."""

    storage: Mapping[int, NamedSharding]
    compute: Mapping[int, NamedSharding]
    gathered: set[int] = field(default_factory=set)


_ACTIVE: contextvars.ContextVar[LayerLayouts | None] = contextvars.ContextVar(
    "theseus_layer_layouts", default=None
)


@contextlib.contextmanager
def layer_layouts(layouts: LayerLayouts) -> Iterator[LayerLayouts]:
    """Install ``layouts`` for the :func:`scan_layers` calls traced inside the block."""
    token = _ACTIVE.set(layouts)
    try:
        yield layouts
    finally:
        _ACTIVE.reset(token)


def _slice(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked array: its spec without the leading dimension."""
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


def _layer_shardings(leaves: list, layouts: LayerLayouts) -> list[tuple | None]:
    """Per leaf, the (storage, compute) sharding of one layer when it is a parameter array the
    trainer knows whose layouts differ, else None (nothing to gather)."""
    shardings = []
    for leaf in leaves:
        if id(leaf) not in layouts.compute:
            shardings.append(None)
            continue
        layouts.gathered.add(id(leaf))
        storage, compute = layouts.storage[id(leaf)], layouts.compute[id(leaf)]
        same = storage.spec == compute.spec  # nothing to move (no FSDP): leave XLA free
        shardings.append(None if same else (_slice(storage), _slice(compute)))
    return shardings


def _gather(leaves: list, shardings: list[tuple | None]) -> list:
    """Each known leaf constrained to its storage, then its compute layout (the gather)."""
    constrain = jax.lax.with_sharding_constraint
    gathered = []
    for leaf, sharding in zip(leaves, shardings, strict=True):
        if sharding is not None:
            storage, compute = sharding
            leaf = constrain(constrain(leaf, storage), compute)
        gathered.append(leaf)
    return gathered


def scan_layers(
    layer_fn: Callable[[Any, Any], Any], carry: Any, layers: Any, *, remat: bool = False
) -> Any:
    """``carry = layer_fn(layer, carry)`` for each layer of ``layers``; returns the last carry.

    ``layers``: the stacked parameters, a pytree of arrays (or an ``nnx.Module``/``nnx.State``
    holding them) whose leaves all have the layer count as their leading dimension; ``layer``
    is the same pytree with that dimension removed. ``remat=True`` recomputes each layer in the
    backward pass (activation checkpointing, which also re-gathers its weights there). Under a
    trainer, each layer's weights are gathered to the compute layout inside the scan body.
    """
    if isinstance(layers, nnx.Module):
        layers = nnx.state(layers)
    if isinstance(layers, nnx.State):
        layers = nnx.to_pure_dict(layers)
    leaves, treedef = jax.tree.flatten(layers)
    active = _ACTIVE.get()
    shardings = [None] * len(leaves) if active is None else _layer_shardings(leaves, active)

    def body(carry, layer):
        layer = treedef.unflatten(_gather(treedef.flatten_up_to(layer), shardings))
        return layer_fn(layer, carry), None

    if remat:
        body = jax.checkpoint(body)  # the gather is recomputed with the layer
    carry, _ = jax.lax.scan(body, carry, layers)
    return carry
