"""Per-device bytes of the persistent state: predicted from layouts and measured on devices."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from theseus.base.layout import is_sharding


@dataclass(frozen=True)
class MemoryFacts:
    """Per-device bytes of the persistent state, predicted from layouts and measured."""

    predicted_params_bytes: int
    predicted_opt_state_bytes: int
    measured_params_bytes: int | None = None
    measured_opt_state_bytes: int | None = None

    @property
    def predicted_bytes(self) -> int:
        return self.predicted_params_bytes + self.predicted_opt_state_bytes

    @property
    def measured_bytes(self) -> int | None:
        if self.measured_params_bytes is None:
            return None
        return self.measured_params_bytes + self.measured_opt_state_bytes


def shard_bytes(abstract: Any, shardings: Any) -> int:
    """Per-device bytes of ``abstract`` placed with ``shardings`` (matching pytrees)."""
    total = 0
    for value, sharding in zip(
        jax.tree.leaves(abstract), jax.tree.leaves(shardings, is_leaf=is_sharding), strict=True
    ):
        shape = sharding.shard_shape(tuple(value.shape))
        total += math.prod(shape) * np.dtype(value.dtype).itemsize
    return total


def device_bytes(tree: Any, device: jax.Device) -> int:
    """Bytes that ``device`` holds of the arrays in ``tree`` (from their addressable shards)."""
    return sum(
        shard.data.nbytes
        for array in jax.tree.leaves(tree)
        for shard in array.addressable_shards
        if shard.device == device
    )
