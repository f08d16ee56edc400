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
