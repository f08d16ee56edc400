"""Per-device bytes: of a state placed in its layouts, of a compiled step, and as text.

One type, :class:`MemoryTotals`, describes the model state per device; the trainer predicts it
from its layouts (and measures it on a state), and the planner compares it across policies.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from theseus.accounting.collectives import Collectives, count_collectives, count_dot_flops
from theseus.accounting.records import json_field
from theseus.sharding.layout import is_sharding


@dataclass(frozen=True)
class MemoryTotals:
    """Per-device bytes of the model state of one policy (activations not included):
    parameters as stored (and their frozen reference copy where the state holds one), the
    float32 gradient accumulator (parameter-shaped, in the storage layout; it lives only inside
    the step) and the optimizer state."""

    params: int = json_field("params_bytes")
    grad_accumulator: int = json_field("grad_accumulator_bytes")
    optimizer: int = json_field("optimizer_bytes")

    json_properties: ClassVar[dict[str, str]] = {"total": "total_bytes"}

    @property
    def total(self) -> int:
        return self.params + self.grad_accumulator + self.optimizer

    @property
    def persistent(self) -> int:
        """What stays on the device between steps: parameters and optimizer state."""
        return self.params + self.optimizer


@dataclass(frozen=True)
class CompiledStep:
    """The train step compiled ahead of time and its per-device bytes (``memory_analysis()``),
    activations included.

    ``executable`` is callable on a state in the trainer's layouts (its HLO is
    ``executable.as_text()``); it is not part of the JSON. ``peak`` is the sum of arguments,
    temporaries and outputs; ``aliased`` of the output bytes reuse donated argument buffers, so
    the sum is an upper bound by that much. ``collectives`` and ``dot_flops`` (the FLOPs of
    its matmuls, recomputation included): per device per step, loops unrolled
    (:mod:`theseus.accounting.collectives`).
    """

    executable: Any = json_field(None, compare=False, repr=False)
    arguments: int = json_field("argument_bytes")
    temporaries: int = json_field("temp_bytes")
    outputs: int = json_field("output_bytes")
    aliased: int = json_field("alias_bytes")
    collectives: Collectives = json_field("collectives", default_factory=Collectives)
    dot_flops: int = json_field("dot_flops", default=0)

    json_properties: ClassVar[dict[str, str]] = {"peak": "peak_bytes"}

    @classmethod
    def of(cls, executable: jax.stages.Compiled) -> CompiledStep:
        stats, text = executable.memory_analysis(), executable.as_text()
        assert stats is not None and text is not None, "XLA gave no memory analysis or HLO text"
        return cls(
            executable=executable,
            arguments=int(stats.argument_size_in_bytes),
            temporaries=int(stats.temp_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            collectives=count_collectives(text),
            dot_flops=count_dot_flops(text),
        )

    @property
    def peak(self) -> int:
        return self.arguments + self.temporaries + self.outputs

    def describe(self) -> str:
        return (
            f"compiled train step, per device: arguments {self.arguments:,}, temporaries "
            f"{self.temporaries:,}, outputs {self.outputs:,} ({self.aliased:,} reuse donated "
            f"arguments); peak (sum) {self.peak:,} bytes = {format_bytes(self.peak)}"
        )


def tree_bytes(tree: Any) -> int:
    """Bytes of every leaf of ``tree`` (arrays or shapes), whole."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


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


def model_state_totals(
    params: Any, opt_state: Any, storage: Any, opt_layout: Any, *, trained: Any = None
) -> MemoryTotals:
    """Per-device model-state bytes of abstract ``params`` and ``opt_state`` in their layouts;
    the gradient sum covers ``trained`` (the trained parameters and their storage layout; by
    default all of them: frozen parameters have none)."""
    grad_params, grad_layout = (params, storage) if trained is None else trained
    float32_params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), grad_params)
    return MemoryTotals(
        params=shard_bytes(params, storage),
        grad_accumulator=shard_bytes(float32_params, grad_layout),
        optimizer=shard_bytes(opt_state, opt_layout),
    )


# --- byte counts as text ----------------------------------------------------------------------

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_BYTES_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgtp]i?)?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """``80GiB`` → 85899345920; ``80GB`` and ``80G`` are decimal; a plain number is bytes."""
    match = _BYTES_PATTERN.match(str(text))
    if not match:
        raise ValueError(
            f"{text!r} is not a byte count; write e.g. 80GiB (binary), 80GB (decimal) or "
            "85899345920."
        )
    number, unit = match.groups()
    unit = (unit or "").lower()
    scale = _BINARY[unit] if unit in _BINARY else _UNITS[unit]
    value = int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive byte count.")
    return value


def format_bytes(num: float) -> str:
    """Binary units to three significant digits: ``1.74 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= scale:
            value = num / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{num:.0f} B"
