"""What a training run's checkpoints hold besides the arrays, and where restored arrays land:
the helpers that know about :class:`TrainState` (the :class:`~theseus.checkpoint.checkpointer.Checkpointer`
itself stores any pytree)."""

from __future__ import annotations

import jax

from theseus.training.trainer import BaseTrainer, TrainState


def restore_target(trainer: BaseTrainer) -> TrainState:
    """The trainer's abstract state with its state layout: where restored arrays must land."""
    return jax.tree.map(
        lambda value, sharding: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding),
        trainer.abstract_state,
        trainer.state_layout,
    )


def checkpoint_meta(trainer: BaseTrainer, data_position: int, step: int | None = None) -> dict:
    """What a checkpoint records besides the state: enough to resume and to audit the run.

    ``data_position`` is the index of the next training example to draw (the loop's position
    after the last completed step). ``step`` is filled in by ``Checkpointer.save`` when absent.
    """
    meta = {
        **trainer.execution_facts(),
        "config": trainer.config.model_dump(mode="json"),
        "data_position": int(data_position),
    }
    if step is not None:
        meta["step"] = int(step)
    return meta
