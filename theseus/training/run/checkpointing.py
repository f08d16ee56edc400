"""What a training run's checkpoints hold besides the arrays, and where restored arrays land:
the helpers that know about :class:`TrainState` (the :class:`~theseus.checkpoint.checkpointer.Checkpointer`
itself stores any pytree)."""

from __future__ import annotations

from theseus.checkpoint.meta import CheckpointMeta
from theseus.sharding.layout import abstract_with
from theseus.training.trainer import BaseTrainer, TrainState


def restore_target(trainer: BaseTrainer) -> TrainState:
    """The trainer's abstract state with its state layout: where restored arrays must land."""
    return abstract_with(trainer.abstract_state, trainer.state_layout)


def checkpoint_meta(trainer: BaseTrainer, *, step: int, data_position: int) -> CheckpointMeta:
    """What a checkpoint of ``step`` records besides the state: enough to resume and to audit
    the run. ``data_position`` is the index of the next training example to draw (the loop's
    position after step ``step``)."""
    return CheckpointMeta(
        step=int(step),
        data_position=int(data_position),
        config=trainer.config.model_dump(mode="json"),
        **trainer.execution_facts(),
    )
