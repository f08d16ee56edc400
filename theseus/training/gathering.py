"""Where the step moves parameters and gradients: pure functions of the layouts.

- Parameters the model runs through :func:`theseus.scan_layers` enter the loss in the storage
  layout and are gathered one layer at a time inside the scan; all others enter in the compute
  layout (gathered before the loss).
- When storage leaves every parameter whole across ``batch`` (DP, ZeRO), each replica keeps its
  own float32 partial gradient sum between microbatches, so gradients cross ``batch`` once per
  step; when storage splits them (FSDP), the sharded accumulator takes a reduction per microbatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from numpy.typing import DTypeLike

from theseus.config import GatherDtype
from theseus.sharding.axis import Axis, Placement, Remat, uses_axis
from theseus.sharding.casting import cast_only_inputs
from theseus.sharding.layer_scan import LayerLayouts, Move, layer_layouts, move_to_compute
from theseus.sharding.layout import Layouts, is_sharding, path_str
from theseus.training.context import TrainerContext
from theseus.training.keys import validation_keys

Value = TypeVar("Value")  # what a loss returns: a scalar, a TokenLoss, logits


def loss_with_layouts(
    loss: Callable[[Any], Value],
    params: Any,
    layouts: Layouts,
    gathered: set[str] | None,
    *,
    cast_dtype: np.dtype | None = None,
    remat: Remat = "none",
    experts: Placement = "none",
) -> Value:
    """``loss(params)`` with ``layouts`` installed for :func:`theseus.scan_layers` (which
    gathers castable weights in ``cast_dtype`` when given and recomputes by ``remat``) and the
    expert layers (their ``experts`` placement); adds the paths of the parameters it gathered
    per layer to ``gathered`` when given."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    ids = [id(leaf) for _, leaf in flat]
    storage, compute = (
        jax.tree.leaves(layout, is_leaf=is_sharding)
        for layout in (layouts.storage, layouts.compute)
    )
    installed = LayerLayouts(
        dict(zip(ids, storage, strict=True)),
        dict(zip(ids, compute, strict=True)),
        cast_dtype=cast_dtype,
        remat=remat,
        experts=experts,
    )
    with layer_layouts(installed):
        value = loss(params)
    if gathered is not None:
        gathered.update(path_str(path) for path, leaf in flat if id(leaf) in installed.gathered)
    return value


def gather_dtype(compute_dtype: DTypeLike, setting: GatherDtype) -> np.dtype | None:
    """The dtype castable parameters are gathered in: the compute dtype under
    ``training.gather_dtype=compute`` (``setting``) when that is narrower than float32 storage,
    else None (their own dtype: float32 compute needs no cast)."""
    compute = np.dtype(compute_dtype)
    narrower = compute.itemsize < np.dtype(np.float32).itemsize
    return compute if setting == "compute" and narrower else None


@dataclass(frozen=True)
class Entry:
    """How parameters enter the loss: their ``layout`` (compute, or storage for those gathered
    per layer), the paths of those moved there in ``dtype`` (``casts``)."""

    layout: Any
    casts: frozenset[str] = frozenset()
    dtype: np.dtype | None = None


def entry(context: TrainerContext, per_layer_paths: Callable[[], frozenset[str]]) -> Entry:
    """The :class:`Entry` of a trainer's parameters (``per_layer_paths()``: those its layer scan
    gathers, :func:`theseus.training.step.per_layer_paths`, an abstract trace of the loss asked
    for only when some parameter's stored layout differs from its compute layout: without FSDP
    nothing is gathered and the parameters enter in compute): the parameters moved before the
    loss (their layouts differ and the layer scan does not gather them) that the loss reads only
    through a cast to the gather dtype are cast on their shards before the move (found by
    tracing the loss once, abstractly, without layouts: :mod:`theseus.sharding.casting`)."""
    layouts = context.layouts
    flat = [
        jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharding)[0]
        for tree in (layouts.storage, layouts.compute)
    ]
    differing = {
        path_str(path)
        for (path, storage), (_, compute) in zip(*flat, strict=True)
        if storage.spec != compute.spec
    }
    if not differing:
        return Entry(layouts.compute)
    gathered = per_layer_paths()
    layout = entry_layout(layouts, gathered)
    dtype = context.gather_dtype
    moved = differing - gathered
    if dtype is None or not moved:
        return Entry(layout)
    shape = (context.batch_plan.per_device_batch_size, context.seq_len + 1)

    def loss(params: Any) -> jax.Array:
        model = nnx.merge(context.graphdef, params)
        tokens = jnp.zeros(shape, jnp.int32)
        return context.loss(model, tokens, validation_keys(shape[:1]), train=True)

    params = context.abstract_state.params
    paths = [path_str(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    found = cast_only_inputs(loss, (params,), dtype, [path in moved for path in paths])
    casts = frozenset(path for path, cast in zip(paths, found, strict=True) if cast)
    return Entry(layout, casts, dtype)


def enter(params: Any, layouts: Layouts, entry: Entry) -> Any:
    """``params`` moved to the layout they enter the loss in; those of ``entry.casts`` cast to
    ``entry.dtype`` on their stored shards first (:func:`move_to_compute`: half the bytes, the
    values the loss would have cast itself). Their gradients are the loss's own, in float32:
    the move happens before differentiation."""

    def move(path, leaf, storage, target):
        if path_str(path) not in entry.casts:
            return jax.lax.with_sharding_constraint(leaf, target)
        return move_to_compute(leaf, Move(storage, target, entry.dtype))

    return jax.tree_util.tree_map_with_path(move, params, layouts.storage, entry.layout)


def entry_layout(layouts: Layouts, per_layer_paths: frozenset[str]) -> Any:
    """The layout parameters enter the loss in: compute, except those gathered per layer inside
    the layer scan, which enter in storage (the whole model is never gathered)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, compute, storage: storage if path_str(path) in per_layer_paths else compute,
        layouts.compute,
        layouts.storage,
        is_leaf=is_sharding,
    )


def accumulating_replicas(storage_layout: Any, replicas: int, accumulation_steps: int) -> int:
    """Replicas keeping their own partial gradient sum between microbatches: all of them when
    storage leaves parameters whole across ``batch`` and there is more than one microbatch,
    else 1 (one microbatch reduces once per step anyway, without the replica dimension's extra
    gradient copy and step time)."""
    storage = jax.tree.leaves(storage_layout, is_leaf=is_sharding)
    split = any(uses_axis(s.spec, Axis.BATCH) for s in storage)
    return 1 if split or accumulation_steps == 1 else replicas


def per_replica(fn: Callable[..., Any], replicas: int) -> Callable[..., Any]:
    """``fn(*shared, *rows)`` of one replica, as a function of ``(shared, *rows)``: ``shared``
    (a tuple) is the same for every replica, each array of ``rows`` and of the results has a
    leading ``(replicas,)`` dim split over ``batch`` (one replica per row of the mesh).

    Each row of the mesh runs ``fn`` on its own slice in a ``shard_map`` that is manual over
    ``batch`` only (TP over ``shard`` stays automatic). ``check_vma=False``: ``shared`` holds the
    parameters, the same on every row, and their gradient must stay the row's own partial sum,
    not be summed across rows. A ``vmap`` with ``spmd_axis_name`` computes the same, but the
    degenerate dims it leaves on each device cost step time (4–7% on CPU: docs/design.md, "One
    gradient reduction per step").
    """

    def local(shared, *rows):  # each array of rows: (1, ...) on this row of the mesh
        return jax.tree.map(lambda out: out[None], fn(*shared, *(r[0] for r in rows)))

    if replicas == 1:
        return local

    def mapped(shared, *rows):
        specs = (P(), *(P(Axis.BATCH),) * len(rows))
        return jax.shard_map(
            local,
            in_specs=specs,
            out_specs=P(Axis.BATCH),
            axis_names={Axis.BATCH},
            check_vma=False,
        )(shared, *rows)

    return mapped


def accumulator_layout(storage_layout: Any, mesh: Mesh | AbstractMesh, replicas: int) -> Any:
    """The float32 gradient sum: (replicas, *parameter), replicas over ``batch`` (when more than
    one), each in the storage layout; per device, the bytes of the parameters as stored."""
    lead = Axis.BATCH if replicas > 1 else None
    return jax.tree.map(
        lambda s: NamedSharding(mesh, P(lead, *s.spec)), storage_layout, is_leaf=is_sharding
    )
