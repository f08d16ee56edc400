"""The optimizer every trainer uses by default: AdamW with gradient clipping, a warmup-cosine
learning-rate schedule, and weight decay on matrices only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from theseus.config import OptimizationConfig
from theseus.sharding.layout import path_str


def learning_rate(opt: OptimizationConfig, steps: int) -> optax.Schedule:
    """Linear warmup over ``opt.warmup_steps`` (at most ``steps``), then cosine decay to
    ``learning_rate × min_learning_rate_ratio`` at ``steps``."""
    warmup = min(opt.warmup_steps, steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=opt.learning_rate * opt.min_learning_rate_ratio,
    )


def decay_mask(names_of: Callable[[], dict[str, Any]]) -> Callable[[Any], Any]:
    """Weight decay applies to matrices: leaves with two or more dims besides ``n_layer``
    (``names_of()``: each parameter path's logical names, read when the optimizer is built)."""

    def mask(params: Any) -> Any:
        names = names_of()

        def is_matrix(path, value):
            leaf_names = names.get(path_str(path))
            stacked = 1 if leaf_names and leaf_names[0] == "n_layer" else 0
            return value.ndim - stacked >= 2

        return jax.tree_util.tree_map_with_path(is_matrix, params)

    return mask


def adamw(
    opt: OptimizationConfig, schedule: optax.Schedule, mask: Callable[[Any], Any]
) -> optax.GradientTransformation:
    """Clipping by global norm, then AdamW with decoupled weight decay where ``mask`` says."""
    return optax.chain(
        optax.clip_by_global_norm(opt.grad_clip),
        optax.adamw(
            schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=mask
        ),
    )
