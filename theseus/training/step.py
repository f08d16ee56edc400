"""A trainer's jitted steps: training (microbatches, one gradient reduction, the update) and
validation, and the placement of a batch on the mesh.

The step moves parameters through the three layouts of the specification:
storage → compute (per microbatch; the gather under FSDP) → update (optimizer) → storage.
The layouts are data (pytrees of ``NamedSharding``); the step only applies them.
:class:`TrainerStep` is that part of :class:`~theseus.training.trainer.BaseTrainer`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.accounting.memory import CompiledStep
from theseus.accounting.preflight import BatchPlan
from theseus.sharding.axis import Axis, ShardingPolicy
from theseus.sharding.layout import Layouts
from theseus.sharding.topology import Topology, under_mesh
from theseus.training import gathering
from theseus.training.finetune import Partition
from theseus.training.keys import Keys, step_keys, validation_keys
from theseus.training.losses import TokenLoss
from theseus.training.nonfinite import update_if_finite
from theseus.training.state import TrainState


class TrainerStep:
    """The train and validation steps and batch placement (a part of ``BaseTrainer``)."""

    policy: ShardingPolicy
    topology: Topology
    mesh: Any
    optimizer: optax.GradientTransformation
    graphdef: nnx.GraphDef
    partition: Partition
    batch_plan: BatchPlan
    layouts: Layouts
    state_layout: TrainState
    abstract_state: TrainState
    seq_len: int
    token_loss: Callable[..., TokenLoss]
    learning_rate: Callable[[], optax.Schedule]

    @property
    def batch_sharding(self) -> NamedSharding:
        """(accumulation, examples, [ROW_FIELDS,] seq_len + 1): examples over ``batch``, shared
        by ``shard``."""
        return NamedSharding(self.mesh, P(None, Axis.BATCH, None))

    def _model_loss(self, rows: jax.Array, keys: Keys, *, train: bool) -> Callable:
        """``params -> TokenLoss``: :meth:`token_loss` of the model built from ``params``."""

        def model_loss(params: Any) -> TokenLoss:
            return self.token_loss(nnx.merge(self.graphdef, params), rows, keys, train=train)

        return model_loss

    def _loss_in_layouts(
        self, params: Any, rows: jax.Array, keys: Keys, *, train: bool
    ) -> TokenLoss:
        """:meth:`token_loss` with the layouts installed for :func:`theseus.scan_layers`."""
        model_loss = self._model_loss(rows, keys, train=train)
        return gathering.loss_with_layouts(
            model_loss,
            params,
            self.layouts,
            None,
            cast_dtype=gathering.gather_dtype(self),
            remat=self.policy.activation_checkpointing,
        )

    @cached_property
    def per_layer_paths(self) -> frozenset[str]:
        """Paths of the parameters the model gathers one layer at a time inside its layer scan
        (:func:`theseus.scan_layers`); found by tracing the loss once, abstractly."""
        found: set[str] = set()
        shape = (self.batch_plan.per_device_batch_size, self.seq_len + 1)

        def loss(p, t):  # traced
            model_loss = self._model_loss(t, validation_keys(shape[:1]), train=True)
            return gathering.loss_with_layouts(model_loss, p, self.layouts, found)

        jax.eval_shape(loss, self.abstract_state.params, jax.ShapeDtypeStruct(shape, jnp.int32))
        return frozenset(found)

    @cached_property
    def entry(self) -> gathering.Entry:
        return gathering.entry(self)

    @cached_property
    def accumulating_replicas(self) -> int:
        return gathering.accumulating_replicas(
            self.partition.trained(self.layouts.storage),
            self.topology.replicas,
            self.batch_plan.accumulation_steps,
        )

    @cached_property
    def accumulator_layout(self) -> Any:
        return gathering.accumulator_layout(
            self.partition.trained(self.layouts.storage), self.mesh, self.accumulating_replicas
        )

    def _train_step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        constrain = jax.lax.with_sharding_constraint
        num_micro, examples = batch.shape[:2]
        replicas = self.accumulating_replicas
        batch = batch.reshape(num_micro, replicas, examples // replicas, *batch.shape[2:])
        rng = step_keys(state.rng, state.step, batch.shape[:3])  # one key per example, and step

        def replica_grads(params, step_key, rows, examples):  # a replica's rows and keys
            trained, frozen = self.partition.split(params)  # gradients of the trained alone

            def loss(trained):
                joined = self.partition.join(trained, frozen)
                summed = self._loss_in_layouts(joined, rows, Keys(examples, step_key), train=True)
                return summed.total, summed

            (_, summed), grads = jax.value_and_grad(loss, has_aux=True)(trained)
            return summed, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        per_replica = gathering.per_replica(replica_grads, replicas)

        def microbatch(carry, inputs):  # sums of losses and gradients, and trained tokens
            grad_sum, loss_sum = carry
            params = gathering.enter(state.params, self.layouts, self.entry)
            summed, grads = per_replica((params, rng.step), *inputs)  # (replicas, ...)
            grad_sum = constrain(jax.tree.map(jnp.add, grad_sum, grads), self.accumulator_layout)
            loss_sum = TokenLoss(
                loss_sum.total + summed.total.sum(), loss_sum.count + summed.count.sum()
            )
            return (grad_sum, loss_sum), None

        trained, frozen = self.partition.split(state.params)
        zeros = jax.tree.map(lambda p: jnp.zeros((replicas, *p.shape), jnp.float32), trained)
        nothing = TokenLoss(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (grad_sum, summed), _ = jax.lax.scan(
            microbatch, (constrain(zeros, self.accumulator_layout), nothing), (batch, rng.examples)
        )
        # The one reduction across replicas of the step, straight into the update layout, and the
        # one division: by the trained tokens of the whole global batch.
        count = summed.count.astype(jnp.float32)
        mean = jax.tree.map(lambda g: g.sum(0) / count, grad_sum)
        update_layout = self.partition.trained(self.layouts.update)
        grads = constrain(mean, update_layout)
        metrics = {
            "loss": summed.mean(),
            "trained_tokens": summed.count,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": self.learning_rate()(state.step),
        }

        def update(params, opt_state):  # the trained parameters; frozen ones pass through
            params = constrain(params, update_layout)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            storage = self.partition.trained(self.layouts.storage)
            return constrain(optax.apply_updates(params, updates), storage), opt_state

        # A non-finite loss or gradient norm keeps the old parameters and optimizer state; the
        # step counter advances either way, so the next step draws the same data and keys.
        trained, opt_state, metrics = update_if_finite(update, trained, state.opt_state, metrics)
        params = self.partition.join(trained, frozen)
        return TrainState(params, opt_state, state.step + 1, state.rng), metrics

    @cached_property
    def train_step(self) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
        """One jitted step: state donated, explicit in/out shardings."""
        replicated = NamedSharding(self.mesh, P())
        step = jax.jit(
            self._train_step,
            in_shardings=(self.state_layout, self.batch_sharding),
            out_shardings=(self.state_layout, replicated),
            donate_argnums=0,
        )
        return under_mesh(step, self.mesh)

    def compile(self, batch_shape: tuple[int, ...] | None = None) -> CompiledStep:
        """The train step compiled ahead of time for this mesh (nothing allocated) for batches
        of ``batch_shape`` (default: the plan's plain token rows): the executable a training
        loop calls, and its per-device memory."""
        shape = self.batch_plan.shape if batch_shape is None else batch_shape
        batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=self.batch_sharding)
        return CompiledStep.of(self.train_step.lower(self.abstract_state, batch).compile())

    def _validation_loss(self, params: Any, batches: jax.Array) -> jax.Array:
        params = jax.lax.with_sharding_constraint(params, self.entry.layout)
        keys = validation_keys(batches.shape[:2])  # examples: (num_batches, examples)

        def one(summed, inputs):  # rows (examples, ...), keys (examples,)
            more = self._loss_in_layouts(params, inputs[0], Keys(inputs[1], keys.step), train=False)
            return TokenLoss(summed.total + more.total, summed.count + more.count), None

        nothing = TokenLoss(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        summed, _ = jax.lax.scan(one, nothing, (batches, keys.examples))
        return summed.mean()

    @cached_property
    def validation_step(self) -> Callable[[Any, jax.Array], jax.Array]:
        """Mean loss over the trained tokens of (num_batches, examples, ...) rows under the
        compute layout."""
        step = jax.jit(
            self._validation_loss,
            in_shardings=(self.layouts.storage, self.batch_sharding),
            out_shardings=NamedSharding(self.mesh, P()),
        )
        return under_mesh(step, self.mesh)

    def put_batch(
        self, rows_for: Callable[[slice], np.ndarray], shape: tuple[int, ...]
    ) -> jax.Array:
        """A global batch array whose devices each read only their own example rows."""

        def fetch(index):
            return np.asarray(rows_for(index[1]), dtype=np.int32)[
                (slice(None), slice(None), *index[2:])
            ]

        return jax.make_array_from_callback(shape, self.batch_sharding, fetch)
