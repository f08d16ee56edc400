"""Preference losses: DPO and its family, as pure functions of per-pair log-probabilities.

Every loss here is computed per pair, from each side's summed completion log-probability under
the policy (and the reference, for the losses that have one) and its number of completion
tokens, exactly as TRL 1.16 computes it (``DPOTrainer`` for ``sigmoid``, ``robust``, ``ipo``,
``hinge`` and ``rpo`` = sigmoid plus its ``sft`` term; ``CPOTrainer`` for ``simpo``;
``ORPOTrainer`` for ``orpo``). A run's loss is the mean of the per-pair losses over the pairs of
its global batch. The SFT term of ``rpo`` and ``orpo`` is per pair the chosen completion's mean
token negative log-likelihood; TRL averages it over the chosen tokens of its batch instead, which
is the same number when the batch's chosen completions have equal lengths (or it is one pair),
and which would make the loss depend on how a global batch is split.

The rewards are TRL's: ``beta`` times the policy's log-ratio to the reference (DPO family), or
``beta`` times the policy's mean token log-probability (the reference-free ``orpo``, ``simpo``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import pydantic
from flax import struct

from theseus.config import Section

LossName = Literal["sigmoid", "robust", "ipo", "hinge", "rpo", "orpo", "simpo"]
#: The losses that compare the policy with no reference model.
REFERENCE_FREE = frozenset({"orpo", "simpo"})
#: The metric names of a preference step, as TRL logs them.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class PreferenceConfig(Section):
    """How a preference run scores its pairs.

    Attributes:
        loss: ``sigmoid`` (DPO), ``robust`` (DPO robust to flipped labels, with
            ``label_smoothing``), ``ipo``, ``hinge``, ``rpo`` (DPO plus ``rpo_alpha`` times the
            chosen completion's NLL), and the reference-free ``orpo`` and ``simpo``.
        beta: the inverse temperature of every loss (IPO's tau; ORPO's lambda).
        label_smoothing: the assumed fraction of flipped labels (``robust``, ``simpo``), in
            [0, 0.5).
        gamma: SimPO's target reward margin (TRL's ``simpo_gamma``).
        rpo_alpha: the weight of RPO's NLL term.
        reference: ``precomputed`` (one pass before training, stored in the run) or ``live``
            (recomputed every step); None: precomputed for the losses with a reference, none
            for ``orpo`` and ``simpo``.
    """

    loss: LossName = pydantic.Field("sigmoid", description="the preference loss")
    beta: float = pydantic.Field(0.1, description="inverse temperature (> 0)")
    label_smoothing: float = pydantic.Field(0.0, description="robust/simpo: flipped fraction")
    gamma: float = pydantic.Field(0.5, description="simpo: target reward margin")
    rpo_alpha: float = pydantic.Field(1.0, description="rpo: weight of the chosen NLL")
    reference: Literal["precomputed", "live"] | None = pydantic.Field(
        None, description="precomputed | live (None: precomputed where the loss has one)"
    )

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> PreferenceConfig:
        problem = settings_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def has_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE

    @property
    def reference_mode(self) -> Literal["precomputed", "live"] | None:
        """How the reference is computed; None for a reference-free loss."""
        if not self.has_reference:
            return None
        return self.reference or "precomputed"


def settings_problem(config: PreferenceConfig) -> str | None:
    """Why ``config``'s settings cannot train, as one sentence to act on; None when they can."""
    if not config.beta > 0:
        return (
            f"preference.beta={config.beta} must be positive: it scales the log-ratios every "
            "preference loss compares (TRL's default is 0.1)."
        )
    if config.reference is not None and not config.has_reference:
        return (
            f"preference.loss={config.loss} is reference-free, but preference.reference="
            f"{config.reference} asks for a reference; remove preference.reference, or choose "
            "a loss with a reference (sigmoid, robust, ipo, hinge, rpo)."
        )
    smoothed = ("robust", "simpo")
    if config.label_smoothing != 0 and config.loss not in smoothed:
        return (
            f"preference.label_smoothing={config.label_smoothing} has no effect on "
            f"preference.loss={config.loss}; use loss=robust (or simpo), or remove it."
        )
    if not 0 <= config.label_smoothing < 0.5:
        return (
            f"preference.label_smoothing={config.label_smoothing} must lie in [0, 0.5): the "
            "fraction of pairs whose labels are assumed flipped."
        )
    if config.rpo_alpha < 0:
        return f"preference.rpo_alpha={config.rpo_alpha} must be >= 0 (the NLL term's weight)."
    return None


@struct.dataclass
class PairLogps:
    """Per pair: the summed completion log-probabilities of each side and their token counts.
    Every field (pairs,) float32."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array

    def mean_chosen(self) -> jax.Array:
        return self.chosen / jnp.maximum(self.chosen_tokens, 1.0)

    def mean_rejected(self) -> jax.Array:
        return self.rejected / jnp.maximum(self.rejected_tokens, 1.0)


@struct.dataclass
class PairLosses:
    """Per pair (each (pairs,) float32): the loss, and what TRL logs of it: the rewards and the
    policy's log-probabilities (sums; means for ``orpo`` and ``simpo``, which score those)."""

    loss: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array
    chosen_logps: jax.Array
    rejected_logps: jax.Array

    def metric_sums(self, valid: jax.Array) -> dict[str, jax.Array]:
        """Each of :data:`METRICS` summed over the pairs where ``valid`` (pairs,) is 1."""
        accuracy = (self.chosen_rewards > self.rejected_rewards).astype(jnp.float32)
        values = (
            self.chosen_rewards,
            self.rejected_rewards,
            accuracy,
            self.chosen_rewards - self.rejected_rewards,
            self.chosen_logps,
            self.rejected_logps,
        )
        return {name: jnp.sum(v * valid) for name, v in zip(METRICS, values, strict=True)}


Scorer = Callable[[PreferenceConfig, PairLogps, PairLogps], PairLosses]


def pair_losses(
    config: PreferenceConfig, policy: PairLogps, reference: PairLogps | None
) -> PairLosses:
    """Each pair's loss and metrics under ``config.loss``; ``reference`` is None exactly for the
    reference-free losses."""
    if (reference is None) == config.has_reference:
        raise ValueError(
            f"preference.loss={config.loss} "
            + ("needs reference log-probabilities" if reference is None else "has no reference")
        )
    if reference is None:
        return _REFERENCE_FREE[config.loss](config, policy)
    return _WITH_REFERENCE[config.loss](config, policy, reference)


def _dpo_family(
    config: PreferenceConfig, policy: PairLogps, reference: PairLogps, loss: jax.Array
) -> PairLosses:
    chosen = config.beta * (policy.chosen - reference.chosen)
    rejected = config.beta * (policy.rejected - reference.rejected)
    return PairLosses(
        loss, jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected),
        jax.lax.stop_gradient(policy.chosen), jax.lax.stop_gradient(policy.rejected),
    )  # fmt: skip


def _margin(policy: PairLogps, reference: PairLogps) -> jax.Array:
    """DPO's score: the chosen log-ratio minus the rejected one, (pairs,)."""
    return (policy.chosen - reference.chosen) - (policy.rejected - reference.rejected)


def sigmoid(config: PreferenceConfig, policy: PairLogps, reference: PairLogps) -> PairLosses:
    loss = -jax.nn.log_sigmoid(config.beta * _margin(policy, reference))
    return _dpo_family(config, policy, reference, loss)


def robust(config: PreferenceConfig, policy: PairLogps, reference: PairLogps) -> PairLosses:
    scaled, smoothing = config.beta * _margin(policy, reference), config.label_smoothing
    clean = -(1 - smoothing) * jax.nn.log_sigmoid(scaled)
    flipped = -smoothing * jax.nn.log_sigmoid(-scaled)
    return _dpo_family(config, policy, reference, (clean - flipped) / (1 - 2 * smoothing))


def ipo(config: PreferenceConfig, policy: PairLogps, reference: PairLogps) -> PairLosses:
    """IPO on log-ratios per completion token (TRL normalises by the completion lengths)."""
    chosen = (policy.chosen - reference.chosen) / jnp.maximum(policy.chosen_tokens, 1.0)
    rejected = (policy.rejected - reference.rejected) / jnp.maximum(policy.rejected_tokens, 1.0)
    loss = (chosen - rejected - 1 / (2 * config.beta)) ** 2
    return _dpo_family(config, policy, reference, loss)


def hinge(config: PreferenceConfig, policy: PairLogps, reference: PairLogps) -> PairLosses:
    loss = jax.nn.relu(1 - config.beta * _margin(policy, reference))
    return _dpo_family(config, policy, reference, loss)


def rpo(config: PreferenceConfig, policy: PairLogps, reference: PairLogps) -> PairLosses:
    """DPO plus ``rpo_alpha`` times the chosen completion's mean token NLL."""
    dpo = sigmoid(config, policy, reference)
    return dataclasses.replace(dpo, loss=dpo.loss - config.rpo_alpha * policy.mean_chosen())


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, stable at both ends (TRL's ``log1mexp``)."""
    return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _reference_free(config: PreferenceConfig, chosen: jax.Array, rejected: jax.Array, loss):
    """Rewards ``beta`` times the policy's mean token log-probabilities (TRL's CPO and ORPO)."""
    chosen, rejected = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
    return PairLosses(loss, config.beta * chosen, config.beta * rejected, chosen, rejected)


def orpo(config: PreferenceConfig, policy: PairLogps) -> PairLosses:
    """The chosen completion's mean NLL minus ``beta`` times the log-sigmoid of the log odds
    ratio of the two completions' mean token probabilities."""
    chosen, rejected = policy.mean_chosen(), policy.mean_rejected()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    loss = -chosen - config.beta * jax.nn.log_sigmoid(log_odds)
    return _reference_free(config, chosen, rejected, loss)


def simpo(config: PreferenceConfig, policy: PairLogps) -> PairLosses:
    """SimPO: the sigmoid loss of ``beta`` times the margin of mean token log-probabilities,
    less ``gamma``, with label smoothing (TRL's CPO ``simpo`` with ``cpo_alpha=0``)."""
    chosen, rejected = policy.mean_chosen(), policy.mean_rejected()
    scaled = config.beta * (chosen - rejected - config.gamma / config.beta)
    smoothing = config.label_smoothing
    loss = -jax.nn.log_sigmoid(scaled) * (1 - smoothing) - jax.nn.log_sigmoid(-scaled) * smoothing
    return _reference_free(config, chosen, rejected, loss)


_WITH_REFERENCE: dict[str, Scorer] = {
    "sigmoid": sigmoid,
    "robust": robust,
    "ipo": ipo,
    "hinge": hinge,
    "rpo": rpo,
}
_REFERENCE_FREE: dict[str, Callable[[PreferenceConfig, PairLogps], PairLosses]] = {
    "orpo": orpo,
    "simpo": simpo,
}
