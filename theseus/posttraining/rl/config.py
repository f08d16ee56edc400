"""The ``rl`` section of an RL job (``NAME/train/rl``): TRL 1.16.0's ``GRPOConfig`` names and
defaults, and what follows from them (the objective's settings, the rows a step reads)."""

from __future__ import annotations

import pydantic

from theseus.config import Section
from theseus.posttraining.rl.objective import (
    ImportanceSampling,
    LossType,
    ObjectiveSettings,
    ScaleRewards,
)


class RLSection(Section):
    """Online RL with verifiable rewards (GRPO and its family), as TRL's ``GRPOTrainer``.

    Attributes:
        loss: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` or ``cispo`` (how the per-token loss
            is aggregated, and cispo's clipped-ratio weighting).
        importance_sampling: ``token``, or ``sequence`` (GSPO: one ratio per completion).
        epsilon, epsilon_high: the clipping range ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` None: ``epsilon``; for ``cispo`` the absolute cap of the ratio).
        delta: an upper bound on the unclipped ratio (two-sided clipping); None: none.
        beta: the weight of the k3 KL to the reference (0: no reference is held).
        kl_bias_correction: the KL term multiplied by the importance ratio (TRL's
            ``use_bias_correction_kl``).
        scale_rewards: divide advantages by the ``group``'s std, the ``batch``'s, or ``none``.
        num_generations: completions per prompt (a group).
        max_completion_length: new tokens per completion at most.
        temperature, top_k, top_p: how completions are sampled (and the temperature the
            training log-probabilities are computed at).
        num_iterations: optimizer steps on each step's completions.
        steps_per_generation: optimizer steps whose batches one generation draws.
        mask_truncated_completions: completions without an end token train nothing.
        rewards: reward functions, ``path/to/file.py:function`` or ``package.module:function``.
        reward_weights: one weight per reward function (None: 1 each).
        tokenizer: a tokenizer folder (or ``tokenizer.json``) for the prompts and completions;
            None: the run's (``--init-from``'s), else UTF-8 bytes.
    """

    loss: LossType = pydantic.Field("dapo", description="grpo | bnpo | dr_grpo | dapo | cispo")
    importance_sampling: ImportanceSampling = pydantic.Field(
        "token", description="token | sequence (GSPO)"
    )
    epsilon: float = pydantic.Field(0.2, gt=0, description="lower clipping range")
    epsilon_high: float | None = pydantic.Field(
        None, gt=0, description="upper clipping range (None: epsilon); cispo: the cap"
    )
    delta: float | None = pydantic.Field(None, gt=1, description="upper bound of the ratio")
    beta: float = pydantic.Field(0.0, ge=0, description="weight of the KL to the reference")
    kl_bias_correction: bool = pydantic.Field(True, description="KL times the ratio")
    scale_rewards: ScaleRewards = pydantic.Field("group", description="group | batch | none")
    num_generations: int = pydantic.Field(8, ge=2, description="completions per prompt")
    max_completion_length: int = pydantic.Field(512, gt=0, description="new tokens at most")
    temperature: float = pydantic.Field(1.0, gt=0, description="sampling temperature")
    top_k: int | None = pydantic.Field(None, gt=0, description="keep the k likeliest tokens")
    top_p: float | None = pydantic.Field(None, gt=0, le=1, description="nucleus probability")
    num_iterations: int = pydantic.Field(1, gt=0, description="steps on each batch")
    steps_per_generation: int = pydantic.Field(1, gt=0, description="steps one generation feeds")
    mask_truncated_completions: bool = pydantic.Field(False, description="unended: no loss")
    rewards: list[str] = pydantic.Field(
        default_factory=list, description="reward functions: file.py:function or module:function"
    )
    reward_weights: list[float] | None = pydantic.Field(None, description="one per function")
    tokenizer: str | None = pydantic.Field(None, description="tokenizer folder (None: the run's)")

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> RLSection:
        weights = self.reward_weights
        if weights is not None and len(weights) != len(self.rewards):
            raise ValueError(
                f"rl.reward_weights has {len(weights)} weight(s) for {len(self.rewards)} reward "
                "function(s) in rl.rewards; give one weight per function, or none (1 each)"
            )
        return self

    @property
    def objective(self) -> ObjectiveSettings:
        """The loss's settings, ``epsilon_high`` resolved."""
        return ObjectiveSettings(
            loss=self.loss,
            importance_sampling=self.importance_sampling,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon if self.epsilon_high is None else self.epsilon_high,
            delta=self.delta,
            beta=self.beta,
            kl_bias_correction=self.kl_bias_correction,
        )

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps that read one generation batch."""
        return self.steps_per_generation * self.num_iterations

    @property
    def reuses_rollouts(self) -> bool:
        """Whether a generation batch trains more than one step: then its log-probabilities
        at generation are kept as the old ones (else the old ones are the current, detached)."""
        return self.steps_per_rollout > 1

    @property
    def weights(self) -> list[float]:
        return [1.0] * len(self.rewards) if self.reward_weights is None else self.reward_weights
