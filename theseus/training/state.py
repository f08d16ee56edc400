"""A trainer's state: parameters, optimizer state, step counter and key, as one pytree.

:class:`~theseus.training.trainer.BaseTrainer` creates it sharded in its storage layout
(``init_state``); it is never whole on one device.
"""

from __future__ import annotations

from typing import Any

from flax import struct


@struct.dataclass
class TrainState:
    """Float32 params, optimizer state, step counter and the run's fixed key (see keys.py).

    The same tree holds a state's arrays, its shapes (``jax.eval_shape``) and its layout
    (``NamedSharding`` leaves): hence ``Any`` for the step and the key too."""

    params: Any
    opt_state: Any
    step: Any  # jax.Array () int32
    rng: Any  # jax.Array: the run's key


@struct.dataclass
class ReferencedState(TrainState):
    """A state that also holds a frozen copy of the starting params, laid out as they are, which
    the loss reads as its reference model every step (a full fine-tuning preference run with
    ``preference.reference=live``). A class of its own, so that every other run's state (and
    checkpoint) keeps the tree it had."""

    reference: Any  # params-shaped, never trained


def train_state(params: Any, opt_state: Any, step: Any, rng: Any, reference: Any) -> TrainState:
    """The state of these parts: a :class:`ReferencedState` where ``reference`` is not None."""
    if reference is None:
        return TrainState(params, opt_state, step, rng)
    return ReferencedState(params, opt_state, step, rng, reference)


def reference_of(state: TrainState) -> Any:
    """The state's frozen reference copy, or None where it holds none."""
    return state.reference if isinstance(state, ReferencedState) else None
