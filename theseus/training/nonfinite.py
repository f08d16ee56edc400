"""Non-finite steps: dropped on device, stopped (or counted) on the host.

The step itself decides, on device, whether its update is kept: when the loss or the gradient
norm is not finite, the parameters and optimizer state leave the step as they entered it and the
metrics carry ``skipped``. The host sees that flag on its one-step-late read of the metrics (no
extra sync) and, per ``training.nonfinite``, stops the run (``stop``) or goes on (``skip``) until
``training.max_skipped_steps`` steps in a row were skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from theseus.training.stops import NonFiniteError

WATCHED = ("loss", "grad_norm")


def keep_if_finite(old: Any, new: Any, metrics: dict) -> tuple[Any, dict]:
    """``new`` state, or ``old`` parameters and optimizer state when a watched metric is not
    finite (traced: inside the jitted step). The step counter and RNG advance either way, so the
    next step draws the same data and keys as in a run without the bad step."""
    finite = jnp.all(jnp.stack([jnp.isfinite(metrics[name]) for name in WATCHED]))

    def pick(new_tree, old_tree):
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_tree, old_tree)

    kept = new.replace(
        params=pick(new.params, old.params), opt_state=pick(new.opt_state, old.opt_state)
    )
    return kept, {**metrics, "skipped": jnp.logical_not(finite)}


def strict_json_row(row: dict) -> dict:
    """``row`` with non-finite floats as ``None`` (JSON ``null``): strict JSON readers such as
    ``jq`` reject the bare ``NaN`` and ``Infinity`` that Python's json writes."""
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in row.items()
    }


class NonFiniteGuard:
    """The host's side of ``training.nonfinite``: fed every metrics row in step order."""

    def __init__(self, mode: str, max_skipped_steps: int, advice: Callable[[], str]):
        self.mode = mode
        self.max_skipped_steps = max_skipped_steps
        self.advice = advice  # () -> what to do next: the newest good checkpoint, if any
        self.skipped_in_a_row = 0

    def check(self, row: dict) -> None:
        """Raise :class:`NonFiniteError` when the run must stop after ``row``'s step."""
        if not row.get("skipped"):
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        bad = ", ".join(
            f"{name} is {row[name]}" for name in WATCHED if not math.isfinite(row[name])
        )
        if self.mode == "skip" and self.skipped_in_a_row < self.max_skipped_steps:
            return
        why = (
            f"training.max_skipped_steps={self.max_skipped_steps} steps in a row were skipped"
            if self.mode == "skip"
            else "training.nonfinite=stop; training.nonfinite=skip would skip such steps"
        )
        raise NonFiniteError(
            f"step {row['step']}: {bad}; its update was not applied and no state after it was "
            f"saved ({why}). {self.advice()}"
        )
