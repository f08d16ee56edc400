"""A trainer's state: parameters, optimizer state, step counter and key, as one pytree.

:class:`~theseus.training.trainer.BaseTrainer` creates it sharded in its storage layout
(``init_state``); it is never whole on one device.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    """Float32 params, optimizer state, step counter and the run's fixed key (see keys.py)."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
