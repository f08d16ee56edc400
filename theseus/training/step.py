"""A trainer's jitted steps: training (microbatches, one gradient reduction, the update) and
validation, and the placement of a batch on the mesh.

The step moves parameters through the three layouts of the specification:
storage → compute (per microbatch; the gather under FSDP) → update (optimizer) → storage.
The layouts are data (pytrees of ``NamedSharding``); the step only applies them. Every function
here reads a :class:`~theseus.training.context.TrainerContext` and, where parameters enter the
loss, its :class:`~theseus.training.gathering.Entry`; none reads the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.accounting.memory import CompiledStep
from theseus.sharding.axis import Axis
from theseus.sharding.layout import Layouts
from theseus.sharding.topology import UnderMesh
from theseus.training import gathering
from theseus.training.context import TrainerContext
from theseus.training.keys import Keys, step_keys, validation_keys
from theseus.training.losses import TokenLoss
from theseus.training.nonfinite import update_if_finite
from theseus.training.state import TrainState, reference_of, train_state

#: One training step: the state and a global batch in, the next state and the metrics out.
TrainStep = Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
#: One validation pass: storage-layout parameters, (num_batches, examples, ...) rows and, where
#: the state holds one, the parameters' reference copy in; the mean loss (``loss``) and the
#: loss's other metrics (:meth:`TokenLoss.means`) out.
ValidationStep = Callable[..., dict[str, jax.Array]]


def batch_sharding(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """(accumulation, examples, [ROW_FIELDS,] seq_len + 1): examples over ``batch``, shared by
    ``shard``."""
    return NamedSharding(mesh, P(None, Axis.BATCH, None))


def model_loss(
    context: TrainerContext, rows: jax.Array, keys: Keys, *, train: bool
) -> Callable[[Any], TokenLoss]:
    """``params -> TokenLoss``: the context's ``token_loss`` of the model built from ``params``."""

    def loss(params: Any) -> TokenLoss:
        return context.token_loss(nnx.merge(context.graphdef, params), rows, keys, train=train)

    return loss


def loss_in_layouts(
    context: TrainerContext,
    params: Any,
    reference: Any,
    rows: jax.Array,
    keys: Keys,
    *,
    train: bool,
) -> TokenLoss:
    """The context's ``token_loss`` with the layouts installed for :func:`theseus.scan_layers`,
    of the model built from ``params`` and the reference model built from ``reference`` (the
    state's frozen copy, laid out as ``params``; None: the loss has none)."""

    def loss(both: tuple[Any, Any]) -> TokenLoss:
        model, frozen = (None if p is None else nnx.merge(context.graphdef, p) for p in both)
        assert model is not None
        return context.token_loss(model, rows, keys, train=train, reference=frozen)

    def paired(layout: Any) -> tuple[Any, Any]:  # the copy is gathered as the parameters are
        return layout, None if reference is None else layout

    compute, storage = context.layouts.compute, context.layouts.storage
    return gathering.loss_with_layouts(
        loss,
        (params, reference),
        Layouts(paired(compute), paired(storage), None),
        None,
        cast_dtype=context.gather_dtype,
        remat=context.policy.activation_checkpointing,
        experts=context.policy.experts,
    )


def per_layer_paths(context: TrainerContext) -> frozenset[str]:
    """Paths of the parameters the model gathers one layer at a time inside its layer scan
    (:func:`theseus.scan_layers`); found by tracing the loss once, abstractly."""
    found: set[str] = set()
    shape = (context.batch_plan.per_device_batch_size, context.seq_len + 1)

    def loss(params: Any, tokens: jax.Array) -> TokenLoss:  # traced
        traced = model_loss(context, tokens, validation_keys(shape[:1]), train=True)
        return gathering.loss_with_layouts(traced, params, context.layouts, found)

    jax.eval_shape(loss, context.abstract_state.params, jax.ShapeDtypeStruct(shape, jnp.int32))
    return frozenset(found)


def train_step(context: TrainerContext, entry: gathering.Entry) -> TrainStep:
    """The training step as a function to trace: microbatches in a scan, one reduction of the
    gradients across replicas, the optimizer update of the trained parameters."""
    trained_storage = context.partition.trained(context.layouts.storage)
    replicas = gathering.accumulating_replicas(
        trained_storage, context.topology.replicas, context.batch_plan.accumulation_steps
    )
    accumulator_layout = gathering.accumulator_layout(trained_storage, context.mesh, replicas)
    partition = context.partition

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        constrain = jax.lax.with_sharding_constraint
        num_micro, examples = batch.shape[:2]
        batch = batch.reshape(num_micro, replicas, examples // replicas, *batch.shape[2:])
        rng = step_keys(state.rng, state.step, batch.shape[:3])  # one key per example, and step

        def replica_grads(params, reference, step_key, rows, examples):  # a replica's rows, keys
            trained, frozen = partition.split(params)  # gradients of the trained alone

            def loss(trained):
                joined = partition.join(trained, frozen)
                keys = Keys(examples, step_key)
                summed = loss_in_layouts(context, joined, reference, rows, keys, train=True)
                return summed.objective(), summed

            (_, summed), grads = jax.value_and_grad(loss, has_aux=True)(trained)
            return summed, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        per_replica = gathering.per_replica(replica_grads, replicas)

        def microbatch(grad_sum, inputs):  # the sum of gradients; each microbatch's losses
            params, reference = (
                None if tree is None else gathering.enter(tree, context.layouts, entry)
                for tree in (state.params, reference_of(state))
            )
            summed, grads = per_replica((params, reference, rng.step), *inputs)  # (replicas, ...)
            grad_sum = constrain(jax.tree.map(jnp.add, grad_sum, grads), accumulator_layout)
            return grad_sum, jax.tree.map(lambda x: x.sum(0), summed)  # replicas summed

        trained, frozen = partition.split(state.params)
        zeros = jax.tree.map(lambda p: jnp.zeros((replicas, *p.shape), jnp.float32), trained)
        grad_sum, per_micro = jax.lax.scan(
            microbatch, constrain(zeros, accumulator_layout), (batch, rng.examples)
        )
        summed: TokenLoss = jax.tree.map(lambda x: x.sum(0), per_micro)
        # The one reduction across replicas of the step, straight into the update layout, and the
        # one division: by the trained tokens of the whole global batch.
        count = summed.count.astype(jnp.float32)
        mean = jax.tree.map(lambda g: g.sum(0) / count, grad_sum)
        update_layout = partition.trained(context.layouts.update)
        grads = constrain(mean, update_layout)
        metrics = {
            "loss": summed.mean(),
            "trained_tokens": summed.trained_tokens(),
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": context.learning_rate(state.step),
            **summed.means(),
        }
        if summed.routing is not None:  # a model with experts: its load-balancing loss
            metrics["aux_loss"] = summed.routing.aux / num_micro
            metrics["router_z_loss"] = summed.routing.z / num_micro
            choices = summed.routing.load.sum()
            metrics["expert_load"] = summed.routing.load / choices
            metrics["dropped_fraction"] = summed.routing.dropped / choices  # 0: dropless

        def update(params, opt_state):  # the trained parameters; frozen ones pass through
            params = constrain(params, update_layout)
            updates, opt_state = context.optimizer.update(grads, opt_state, params)
            storage = partition.trained(context.layouts.storage)
            return constrain(optax.apply_updates(params, updates), storage), opt_state

        # A non-finite loss or gradient norm keeps the old parameters and optimizer state; the
        # step counter advances either way, so the next step draws the same data and keys.
        trained, opt_state, metrics = update_if_finite(update, trained, state.opt_state, metrics)
        params = partition.join(trained, frozen)
        next_state = train_state(params, opt_state, state.step + 1, state.rng, reference_of(state))
        return next_state, metrics

    return step


def jitted_train_step(context: TrainerContext, entry: gathering.Entry) -> UnderMesh:
    """One jitted step: state donated, explicit in/out shardings, run under the mesh."""
    replicated = NamedSharding(context.mesh, P())
    step = jax.jit(
        train_step(context, entry),
        in_shardings=(context.state_layout, batch_sharding(context.mesh)),
        out_shardings=(context.state_layout, replicated),
        donate_argnums=0,
    )
    return UnderMesh(step, context.topology.device_mesh)


def compile_train_step(
    context: TrainerContext, step: UnderMesh, batch_shape: tuple[int, ...]
) -> CompiledStep:
    """``step`` (a :func:`jitted_train_step`) compiled ahead of time for batches of
    ``batch_shape`` (nothing allocated): the executable a training loop calls, and its
    per-device memory."""
    batch = jax.ShapeDtypeStruct(batch_shape, np.int32, sharding=batch_sharding(context.mesh))
    return CompiledStep.of(step.lower(context.abstract_state, batch).compile())


def validation_loss(context: TrainerContext, entry: gathering.Entry) -> ValidationStep:
    """The mean loss over the trained tokens (or pairs) of (num_batches, examples, ...) rows, and
    the loss's other metrics, parameters in the compute layout (those gathered per layer in
    storage)."""

    def mean_loss(params: Any, batches: jax.Array, reference: Any = None) -> dict[str, jax.Array]:
        params, reference = (
            None if tree is None else jax.lax.with_sharding_constraint(tree, entry.layout)
            for tree in (params, reference)
        )
        keys = validation_keys(batches.shape[:2])  # examples: (num_batches, examples)

        def one(summed: TokenLoss, inputs: tuple[jax.Array, jax.Array]) -> tuple[TokenLoss, None]:
            rows, examples = inputs  # (examples, ...), (examples,)
            row_keys = Keys(examples, keys.step)
            more = loss_in_layouts(context, params, reference, rows, row_keys, train=False)
            return summed.plus(more), None

        summed, _ = jax.lax.scan(one, context.zero_loss(), (batches, keys.examples))
        return {"loss": summed.mean(), **summed.means()}

    return mean_loss


def jitted_validation_step(context: TrainerContext, entry: gathering.Entry) -> UnderMesh:
    """:func:`validation_loss` jitted: parameters (and their reference copy, where the state
    holds one) in storage, the losses replicated."""
    storage, reference = context.layouts.storage, reference_of(context.state_layout)
    inputs = (storage, batch_sharding(context.mesh))
    step = jax.jit(
        validation_loss(context, entry),
        in_shardings=inputs if reference is None else (*inputs, reference),
        out_shardings=NamedSharding(context.mesh, P()),
    )
    return UnderMesh(step, context.topology.device_mesh)


def jitted_scoring_pass(
    context: TrainerContext,
    entry: gathering.Entry,
    score: Callable[[nnx.Module, jax.Array, Keys], jax.Array],
) -> UnderMesh:
    """A jitted pass of ``score(model, rows, keys)`` (no gradient) over (num, examples, ...)
    batches of rows, a microbatch at a time, the parameters in storage gathered as the step
    gathers them (per layer under FSDP); the scores (num, ...) out, replicated. What a
    preference run's precomputed reference and an RL batch's old log-probabilities are."""

    def run(params: Any, batches: jax.Array) -> jax.Array:
        params = jax.lax.with_sharding_constraint(params, entry.layout)
        keys = validation_keys(batches.shape[:2])

        def one(carry: None, inputs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
            rows, examples = inputs

            def scored(params: Any) -> jax.Array:
                model = nnx.merge(context.graphdef, params)
                return score(model, rows, Keys(examples, keys.step))

            return None, gathering.loss_with_layouts(
                scored,
                params,
                context.layouts,
                None,
                cast_dtype=context.gather_dtype,
                remat=context.policy.activation_checkpointing,
                experts=context.policy.experts,
            )

        return jax.lax.scan(one, None, (batches, keys.examples))[1]

    step = jax.jit(
        run,
        in_shardings=(context.layouts.storage, batch_sharding(context.mesh)),
        out_shardings=NamedSharding(context.mesh, P()),
    )
    return UnderMesh(step, context.topology.device_mesh)


def put_batch(
    mesh: Mesh | AbstractMesh, rows_for: Callable[[slice], np.ndarray], shape: tuple[int, ...]
) -> jax.Array:
    """A global batch array whose devices each read only their own example rows."""

    def fetch(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # a batch is never a scalar
        return np.asarray(rows_for(index[1]), dtype=np.int32)[
            (slice(None), slice(None), *index[2:])
        ]

    return jax.make_array_from_callback(shape, batch_sharding(mesh), fetch)
