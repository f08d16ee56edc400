"""What a trainer's steps need, as one frozen value that :class:`~theseus.training.trainer.BaseTrainer`
builds once: the mesh, the three layouts and the state's, the trained/frozen partition, the
optimizer and its schedule, the batch plan and the loss.

The step (:mod:`theseus.training.step`) and the gathering functions
(:mod:`theseus.training.gathering`) read these and nothing else of the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from theseus.accounting.preflight import BatchPlan
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import Layouts
from theseus.sharding.topology import Topology
from theseus.training.finetune import Partition
from theseus.training.keys import Keys
from theseus.training.losses import TokenLoss
from theseus.training.state import TrainState


class Loss(Protocol):
    """The mean loss of a model on token rows (examples, seq_len + 1)."""

    def __call__(
        self, model: nnx.Module, tokens: jax.Array, keys: Keys, *, train: bool
    ) -> jax.Array: ...


class RowsLoss(Protocol):
    """The :class:`TokenLoss` (summed, and its trained-token count) of a model on rows;
    ``reference``: the model built from the state's reference copy, where it holds one."""

    def __call__(
        self,
        model: nnx.Module,
        rows: jax.Array,
        keys: Keys,
        *,
        train: bool,
        reference: nnx.Module | None = None,
    ) -> TokenLoss: ...


@dataclass(frozen=True)
class TrainerContext:
    """What the train and validation steps read; built once, with the trainer.

    ``loss`` is the trainer's mean loss on plain token rows (what the gather-dtype trace
    follows), ``token_loss`` what the steps add up, ``zero_loss`` its sum over nothing; ``gather_dtype`` the dtype castable
    parameters are gathered in (None: their own); ``seq_len`` tokens an example trains on."""

    topology: Topology
    policy: ShardingPolicy
    graphdef: nnx.GraphDef
    abstract_state: TrainState
    layouts: Layouts
    state_layout: TrainState
    partition: Partition
    optimizer: optax.GradientTransformation
    learning_rate: optax.Schedule
    batch_plan: BatchPlan
    seq_len: int
    loss: Loss
    token_loss: RowsLoss
    zero_loss: Callable[[], TokenLoss]
    gather_dtype: np.dtype | None

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        return self.topology.mesh
