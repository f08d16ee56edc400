"""Non-finite steps are dropped on device: when the loss or the gradient norm is not finite, the
parameters and optimizer state leave the step as they entered it and the metrics carry
``skipped``. The host's side (stop, or count skipped steps) is
:class:`theseus.training.run.stops.NonFiniteGuard`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

WATCHED = ("loss", "grad_norm")


def update_if_finite(
    update: Callable[[Any, Any], tuple[Any, Any]], params: Any, opt_state: Any, metrics: dict
) -> tuple[Any, Any, dict]:
    """``update(params, opt_state)`` when every watched metric is finite, else both as they are
    (traced: inside the jitted step); the metrics gain ``skipped``. A conditional rather than a
    select between old and new state: with the state donated, a select keeps both alive and XLA
    copies the optimizer state (a test checks the step's temporaries)."""
    finite = jnp.all(jnp.stack([jnp.isfinite(metrics[name]) for name in WATCHED]))
    params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o), params, opt_state)
    return params, opt_state, {**metrics, "skipped": jnp.logical_not(finite)}
