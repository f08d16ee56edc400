"""A trainer's state: created sharded in its storage layout, and its predicted and measured bytes.

:class:`TrainerState` is the part of :class:`~theseus.training.trainer.BaseTrainer` that builds
the state (parameters, optimizer state, step, key) and lays it out; it never holds the state whole
on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.accounting.memory import MemoryTotals, device_bytes, model_state_totals
from theseus.sharding.axis import PHASES, ShardingPlan, ShardingPolicy
from theseus.sharding.layout import Layouts, check_layouts, optimizer_layout, resolve_layouts
from theseus.training.finetune import Partition


@struct.dataclass
class TrainState:
    """Float32 params, optimizer state, step counter and the run's fixed key (see keys.py)."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


class TrainerState:
    """Sharded initialisation, the state's layouts and its bytes (a part of ``BaseTrainer``)."""

    config: Any  # a TrainerConfig
    plan: ShardingPlan
    policy: ShardingPolicy
    mesh: Any
    optimizer: optax.GradientTransformation
    abstract_params: nnx.State
    partition: Partition
    layouts: Layouts
    state_layout: TrainState
    build_model: Callable[[nnx.Rngs], nnx.Module]
    frozen_dtype: jnp.dtype

    def _init_fn(self, seed: jax.Array) -> TrainState:
        init_key, rng = jax.random.split(jax.random.PRNGKey(seed))
        with nnx.use_eager_sharding(False):
            model = self.build_model(nnx.Rngs(params=init_key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        params = self.partition.cast_frozen(params, self.frozen_dtype)
        opt_state = self.optimizer.init(self.partition.trained(params))  # none for frozen ones
        return TrainState(params, opt_state, jnp.zeros((), jnp.int32), rng)

    @functools.cached_property
    def abstract_state(self) -> TrainState:
        return jax.eval_shape(self._init_fn, 0)

    def _resolve_layouts(self, policy: ShardingPolicy, mesh: Any) -> Layouts:
        annotated = resolve_layouts(self.abstract_params, self.plan, policy, mesh)
        return Layouts(*(nnx.to_pure_dict(annotated[p]) for p in PHASES))

    def _optimizer_layout(self, update_layout: Any, mesh: Any) -> Any:
        update_layout = self.partition.trained(update_layout)
        return optimizer_layout(self.optimizer, self.abstract_state.opt_state, update_layout, mesh)

    def _state_layout(self) -> TrainState:
        replicated = NamedSharding(self.mesh, P())
        opt_layout = self._optimizer_layout(self.layouts.update, self.mesh)
        return TrainState(self.layouts.storage, opt_layout, replicated, replicated)

    def init_state(self, seed: int | None = None) -> TrainState:
        """Create the state directly in its layouts; it is never whole on one device."""
        seed = self.config.training.seed if seed is None else seed
        init = jax.jit(self._init_fn, out_shardings=self.state_layout)
        with jax.set_mesh(self.mesh):
            return init(seed)

    def memory(self, policy: ShardingPolicy | None = None, mesh: Any = None) -> MemoryTotals:
        """Per-device model-state bytes predicted from this trainer's layouts; with ``policy``
        and/or ``mesh`` (real or abstract), from the layouts they would give after the same
        layout check (raises :class:`~theseus.sharding.layout.LayoutError`). No trainer is built."""
        if policy is None and mesh is None:
            storage, opt_layout = self.layouts.storage, self.state_layout.opt_state
        else:
            policy = self.policy if policy is None else policy
            mesh = self.mesh if mesh is None else mesh
            check_layouts(self.abstract_params, self.plan, policy, mesh)
            layouts = self._resolve_layouts(policy, mesh)
            storage, opt_layout = layouts.storage, self._optimizer_layout(layouts.update, mesh)
        params, trained = self.abstract_state.params, self.partition.trained
        opt_state = self.abstract_state.opt_state
        return model_state_totals(
            params, opt_state, storage, opt_layout, trained=(trained(params), trained(storage))
        )

    def measured_memory(self, state: TrainState) -> MemoryTotals:
        """Bytes of ``state`` on this process's first device of the mesh (no gradient
        accumulator: it exists only inside the step)."""
        here = jax.process_index()
        device = next(d for d in self.mesh.devices.flat if d.process_index == here)
        return MemoryTotals(
            params=device_bytes(state.params, device),
            grad_accumulator=0,
            optimizer=device_bytes(state.opt_state, device),
        )
