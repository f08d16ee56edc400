"""The GRPO family's objective as pure functions, exactly as TRL 1.16's ``GRPOTrainer`` computes it.

A trainer composes three parts. :func:`group_advantages` (host side, once per generation batch)
turns each completion's reward into an advantage relative to the other completions of its prompt.
:func:`token_terms` (on the devices, differentiable in the policy's log-probabilities) gives every
completion token its loss, KL and clip indicators, not yet aggregated. :func:`aggregation_weights`
and :func:`metric_weights` (host side) are the per-token factors that turn those into one optimizer
step's loss and logged metrics, with TRL's normalizer for each loss type, its division by gradient
accumulation and its several optimizer steps per generation batch. Keeping the weights apart from
the terms lets a step sum ``weights × terms`` over any split of its rows (microbatches, devices)
and still get TRL's number.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from theseus.config import check_int

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]
ImportanceSampling = Literal["token", "sequence"]
ScaleRewards = Literal["group", "batch", "none"]

#: TRL's epsilon added to the standard deviation that scales the advantages.
STD_EPSILON = 1e-4


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveSettings:
    """What shapes the per-token loss; the defaults are TRL's ``GRPOConfig`` defaults.

    Attributes:
        loss: TRL's ``loss_type``: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` (clipped
            surrogates that differ only in aggregation) or ``cispo`` (a clipped, detached
            importance weight times the log-probability).
        importance_sampling: TRL's ``importance_sampling_level``: ``token`` (a ratio per token)
            or ``sequence`` (GSPO: one ratio per completion, from its mean token log-ratio).
        epsilon: the lower clip, the ratio clipped below at ``1 - epsilon``.
        epsilon_high: the upper clip, at ``1 + epsilon_high`` (for ``cispo`` the ratio's cap
            itself); TRL's default is ``epsilon``, which the caller resolves.
        delta: the upper bound of two-sided clipping (INTELLECT-2), or None.
        beta: the weight of the per-token KL to the reference; 0 needs no reference.
        kl_bias_correction: TRL's ``use_bias_correction_kl``: the KL multiplied by the
            importance ratio.
    """

    loss: LossType = "dapo"
    importance_sampling: ImportanceSampling = "token"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    kl_bias_correction: bool = True


@dataclasses.dataclass(frozen=True)
class Advantages:
    """A generation batch's advantages and TRL's reward metrics.

    Attributes:
        advantages: (completions,) float32; 0 where the reward is NaN (unscorable).
        group_std: (completions,) the Bessel-corrected standard deviation of each completion's
            group, NaN where the group has fewer than two scored completions (0 for groups of
            one, as TRL).
        reward: the mean of the scored rewards (TRL's ``reward``).
        reward_std: their Bessel-corrected standard deviation over the batch (``reward_std``).
        frac_reward_zero_std: the fraction of completions whose scaling standard deviation is 0
            (``frac_reward_zero_std``): the group's, or the batch's under ``scale="batch"``.
    """

    advantages: np.ndarray
    group_std: np.ndarray
    reward: float
    reward_std: float
    frac_reward_zero_std: float


def _nanmean(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """torch.nanmean: NaN where nothing is left, without NumPy's warning."""
    valid = ~np.isnan(values)
    count = valid.sum(axis=axis, keepdims=True)
    total = np.where(valid, values, 0.0).sum(axis=axis, keepdims=True)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _nanstd(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """TRL's ``nanstd``: the NaN-ignoring standard deviation, Bessel-corrected, NaN below two
    values."""
    count = (~np.isnan(values)).sum(axis=axis, keepdims=True)
    variance = _nanmean((values - _nanmean(values, axis)) ** 2, axis)
    correction = np.where(count > 1, count / np.maximum(count - 1, 1), np.nan)
    return np.sqrt(variance * correction)


def group_advantages(rewards: np.ndarray, num_generations: int, scale: ScaleRewards) -> Advantages:
    """Each completion's reward minus its group's mean (``num_generations`` consecutive
    completions of one prompt), divided by the group's standard deviation + 1e-4 (``group``),
    the batch's (``batch``) or nothing (``none``), as TRL's ``sum_then_normalize``.

    ``rewards`` (completions,) is each completion's weighted sum of its reward functions'
    scores, a None score left out (TRL's nansum), NaN where every function returned None: such a
    completion is left out of every mean and deviation and gets advantage 0. Computed in
    float64: a group of equal rewards gets advantage 0 and a zero deviation, where TRL's float32
    can leave a rounding residue (rewards of 0.7: deviation 6e-8, advantages 6e-4).
    """
    check_int("num_generations", num_generations, minimum=1)
    rewards = np.asarray(rewards, np.float64)  # (completions,)
    if rewards.ndim != 1 or rewards.size % num_generations:
        raise ValueError(
            f"rewards of shape {rewards.shape} do not split into groups of num_generations="
            f"{num_generations}; pass one reward per completion, whole groups only."
        )
    groups = rewards.reshape(-1, num_generations)  # (prompts, num_generations)
    mean = np.repeat(_nanmean(groups, axis=1)[:, 0], num_generations)  # (completions,)
    if num_generations > 1:
        group_std = np.repeat(_nanstd(groups, axis=1)[:, 0], num_generations)
    else:
        group_std = np.zeros_like(rewards)
    reward_std = float(_nanstd(rewards).reshape(()))  # NaN below two scored rewards
    if scale == "batch":
        std = np.full_like(rewards, reward_std if rewards.size > 1 else 0.0)
    elif scale in ("group", "none"):
        std = group_std
    else:
        raise ValueError(f"scale_rewards={scale!r} must be one of 'group', 'batch', 'none'.")
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPSILON)
    return Advantages(
        advantages=np.nan_to_num(advantages, nan=0.0).astype(np.float32),
        group_std=group_std,
        reward=float(_nanmean(rewards).reshape(())),
        reward_std=reward_std,
        frac_reward_zero_std=float(np.mean(np.abs(std) <= 1e-8)),  # torch.isclose(std, 0)
    )


@struct.dataclass
class TokenTerms:
    """Per completion token, each (batch, seq) float32 and not yet masked or aggregated.

    Attributes:
        loss: TRL's ``per_token_loss``, the ``beta`` × KL term included.
        kl: the k3 estimate of KL(policy ‖ reference), times the importance ratio under
            ``kl_bias_correction`` (what TRL logs as ``kl``); zeros when ``beta == 0``.
        low_clipped, high_clipped, region_clipped: 1 where TRL counts the token in
            ``clip_ratio/low_mean``, ``high_mean``, ``region_mean``. For ``cispo``,
            ``high_clipped`` and ``region_clipped`` are TRL's ``cispo_clip_ratio`` indicator
            (ratio above ``epsilon_high``, advantage positive) and ``low_clipped`` is 0. Under
            ``importance_sampling="sequence"`` the three are per completion, the same at every
            position: weigh them with ``metric_weights(..., per_sequence=True)``.
    """

    loss: jax.Array
    kl: jax.Array
    low_clipped: jax.Array
    high_clipped: jax.Array
    region_clipped: jax.Array


def token_terms(
    settings: ObjectiveSettings,
    logps: jax.Array,
    old_logps: jax.Array,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
) -> TokenTerms:
    """TRL's ``_compute_loss`` up to its aggregation: the completion tokens' log-probabilities
    under the policy (``logps``, the only input gradients flow through), the policy that sampled
    them (``old_logps``) and the reference (``ref_logps``, None exactly when ``beta == 0``), all
    (batch, seq) float32; ``advantages`` (batch,); ``mask`` (batch, seq) 0/1, which enters only
    the sequence-level importance ratio."""
    if (ref_logps is None) != (settings.beta == 0.0):
        raise ValueError(
            f"beta={settings.beta} "
            + ("needs reference log-probabilities" if ref_logps is None else "has no reference")
        )
    old_logps = jax.lax.stop_gradient(old_logps)
    advantage = jax.lax.stop_gradient(advantages)[:, None]  # (batch, 1)
    log_ratio = logps - old_logps  # (batch, seq)
    if settings.importance_sampling == "sequence":
        tokens = jnp.maximum(mask.sum(-1, keepdims=True), 1.0)  # (batch, 1)
        log_weight = (log_ratio * mask).sum(-1, keepdims=True) / tokens  # (batch, 1)
    else:
        log_weight = log_ratio  # (batch, seq)
    ratio = jnp.exp(log_weight)  # (batch, seq) or (batch, 1)

    if ref_logps is not None:
        to_reference = jax.lax.stop_gradient(ref_logps) - logps  # (batch, seq)
        kl = jnp.exp(to_reference) - to_reference - 1.0
        if settings.kl_bias_correction:
            kl = kl * ratio
    else:
        kl = jnp.zeros_like(logps)

    if settings.loss == "cispo":
        capped = jax.lax.stop_gradient(jnp.minimum(ratio, settings.epsilon_high))
        loss = -capped * advantage * logps  # (batch, seq)
        high = (ratio > settings.epsilon_high) & (advantage > 0)
        low = jnp.zeros_like(high)
        region = high
    else:
        clipped = jnp.clip(ratio, 1.0 - settings.epsilon, 1.0 + settings.epsilon_high)
        if settings.delta is not None:
            ratio = jnp.minimum(ratio, settings.delta)  # TRL counts clips on this ratio too
        loss = -jnp.minimum(ratio * advantage, clipped * advantage)
        low = (ratio < 1.0 - settings.epsilon) & (advantage < 0)
        high = (ratio > 1.0 + settings.epsilon_high) & (advantage > 0)
        region = low | high
    if ref_logps is not None:
        loss = loss + settings.beta * kl

    shape = logps.shape
    return TokenTerms(
        loss=jnp.broadcast_to(loss, shape),
        kl=kl,
        low_clipped=jnp.broadcast_to(low, shape).astype(jnp.float32),
        high_clipped=jnp.broadcast_to(high, shape).astype(jnp.float32),
        region_clipped=jnp.broadcast_to(region, shape).astype(jnp.float32),
    )


def _microbatches(mask: np.ndarray, steps: int, accumulation: int) -> np.ndarray:
    """``mask`` (rows, seq) as (steps × accumulation, microbatch rows, seq) float64: rows
    step-major, then microbatch-major within a step."""
    check_int("steps", steps, minimum=1)
    check_int("accumulation", accumulation, minimum=1)
    mask = np.asarray(mask, np.float64)
    if mask.ndim != 2 or mask.shape[0] % (steps * accumulation):
        raise ValueError(
            f"a generation batch's mask of shape {mask.shape} does not split into steps={steps} × "
            f"accumulation={accumulation} equal microbatches; pass (rows, seq) with rows a "
            "multiple of steps × accumulation."
        )
    return mask.reshape(steps * accumulation, -1, mask.shape[1])


def aggregation_weights(
    loss: LossType,
    mask: np.ndarray,
    *,
    steps: int,
    accumulation: int,
    max_completion_length: int,
) -> np.ndarray:
    """(rows, seq) float64 factors ``w`` such that one optimizer step's loss, as TRL accumulates
    it (``gradient_accumulation_steps=accumulation``, ``steps_per_generation=steps ×
    accumulation``, one process), is the sum over the step's rows of ``w × TokenTerms.loss``.

    ``mask`` (rows, seq) covers the whole generation batch. TRL divides each microbatch's
    ``grpo`` (sequence means, then their mean), ``bnpo`` (the microbatch's token mean) and
    ``dr_grpo`` (sum over rows × ``max_completion_length``) by ``accumulation``; ``dapo`` and
    ``cispo`` divide the sum by the generation batch's active tokens over ``steps`` (TRL's
    ``num_items_in_batch`` × accumulation / steps_per_generation), whatever the accumulation.
    """
    check_int("max_completion_length", max_completion_length, minimum=1)
    blocks = _microbatches(mask, steps, accumulation)  # (micro, rows, seq)
    rows = blocks.shape[1]
    if loss == "grpo":
        tokens = np.maximum(blocks.sum(-1, keepdims=True), 1.0)  # (micro, rows, 1)
        weights = blocks / tokens / rows / accumulation
    elif loss == "bnpo":
        tokens = np.maximum(blocks.sum((1, 2), keepdims=True), 1.0)  # (micro, 1, 1)
        weights = blocks / tokens / accumulation
    elif loss == "dr_grpo":
        weights = blocks / (rows * max_completion_length) / accumulation
    elif loss in ("dapo", "cispo"):
        weights = blocks * steps / max(float(blocks.sum()), 1.0)
    else:
        raise ValueError(f"loss={loss!r} must be one of grpo, bnpo, dr_grpo, dapo, cispo.")
    return weights.reshape(mask.shape)


def metric_weights(
    mask: np.ndarray, *, steps: int, accumulation: int, per_sequence: bool = False
) -> np.ndarray:
    """(rows, seq) float64 factors that make a token metric (``kl``, the clip indicators, the
    entropy) what TRL logs for each optimizer step: each microbatch's masked token mean (0 for a
    microbatch without tokens), averaged over the step's ``accumulation`` microbatches.

    ``per_sequence``: a metric with one value per completion, read at its first position (TRL's
    clip ratios under sequence-level importance sampling), averaged over every completion of the
    microbatch, empty ones included.
    """
    blocks = _microbatches(mask, steps, accumulation)  # (micro, rows, seq)
    if per_sequence:
        weights = np.zeros_like(blocks)
        weights[:, :, 0] = 1.0 / (blocks.shape[1] * accumulation)
    else:
        tokens = np.maximum(blocks.sum((1, 2), keepdims=True), 1.0)  # (micro, 1, 1)
        weights = blocks / tokens / accumulation
    return weights.reshape(np.shape(mask))
