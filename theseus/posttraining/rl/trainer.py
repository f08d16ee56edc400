"""Online RL of a model family (``NAME/train/rl``): the family's trainer reading completion rows
(:mod:`theseus.posttraining.rl.rows`) and adding up TRL's GRPO-family loss
(:mod:`theseus.posttraining.rl.objective`) on the shared step.

``training.batch_size`` counts completions (``rl.num_generations`` per prompt), split over
accumulation and replicas as every batch is. Each completion token carries its loss weight (TRL's
aggregation of its loss type over the step, times the step's completions), so the step's one
division by its completions gives TRL's loss whatever the layout. The log-probabilities are those
of the logits over ``rl.temperature``. The reference (``rl.beta`` > 0) is the model the run
starts from: a LoRA run's base with the adapters off, else a frozen copy of the starting
parameters in the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

from theseus.accounting.memory import CompiledStep
from theseus.model.decoder import DecoderModel
from theseus.model.lora import with_zero_adapters
from theseus.posttraining.rl.config import RLSection
from theseus.posttraining.rl.objective import token_terms
from theseus.posttraining.rl.rows import (
    ADVANTAGE,
    CLIP_WEIGHT,
    LOSS_WEIGHT,
    METRIC_WEIGHT,
    OLD_LOGPS,
    RL_FIELDS,
    SAMPLER_LOGPS,
)
from theseus.training.family import FamilyTrainer
from theseus.training.keys import Keys
from theseus.training.losses import (
    TokenLoss,
    row_fields,
    segment_positions,
    target_weights,
    with_routing,
)


class RLTrainer(FamilyTrainer):
    """A family's trainer on completion rows (subclassed per family: :func:`rl_trainer_class`)."""

    @property
    def rl(self) -> RLSection:
        # The config class rl_trainer_class makes has the section; the base class's does not.
        return self.config.rl  # type: ignore[attr-defined]

    @property
    def prompt_width(self) -> int:
        """The most tokens a prompt may have: the rows' sequence length less the completion's."""
        return self.seq_len - self.rl.max_completion_length

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """A step's global batch of completion rows: (accumulation, examples, RL_FIELDS,
        seq_len + 1) int32."""
        return (*self.batch_plan.shape[:2], RL_FIELDS, self.seq_len + 1)

    @property
    def num_completions(self) -> int:
        """Completions of one generation batch: ``training.batch_size`` for each of the
        ``rl.steps_per_generation`` steps it feeds."""
        return self.batch_plan.global_batch_size * self.rl.steps_per_generation

    def compile(self, batch_shape: tuple[int, ...] | None = None) -> CompiledStep:
        """The step compiled ahead of time for completion rows (default :attr:`batch_shape`)."""
        return super().compile(self.batch_shape if batch_shape is None else batch_shape)

    @property
    def holds_reference(self) -> bool:
        """A full fine-tuning run with ``rl.beta`` > 0 keeps a frozen copy of its starting
        parameters (a LoRA run's reference is the base with the adapters off: no copy)."""
        return self.rl.beta > 0 and self.config.finetune.lora_rank == 0

    def metric_names(self) -> tuple[str, ...]:
        """The token metrics a step reports, as TRL names them."""
        names = (
            "entropy",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "clip_ratio/region_mean",
            "sampling/sampling_logp_difference/mean",
            "sampling/importance_sampling_ratio/mean",
        )
        return (*names, "kl") if self.rl.beta > 0 else names

    def token_loss(
        self,
        model: nnx.Module,
        rows: jax.Array,
        keys: Keys,
        *,
        train: bool,
        reference: nnx.Module | None = None,
    ) -> TokenLoss:
        """TRL's loss of completion rows (examples, RL_FIELDS, seq_len + 1), summed with each
        token's loss weight, the number of completions, and the token metrics summed with their
        metric weights. Plain token rows (the FLOP count's and the gather trace's) get the
        next-token loss."""
        if rows.ndim == 2:
            return super().token_loss(model, rows, keys, train=train)
        assert isinstance(model, DecoderModel), type(model)  # every family's model is one
        rl = self.rl
        tokens, mask, segments = row_fields(rows)  # each (examples, seq_len + 1)
        inputs = segments[:, :-1]  # (examples, seq_len)

        def scored(scorer: DecoderModel):
            return scorer.sampled_logps(
                tokens[:, :-1],
                tokens[:, 1:],
                keys.examples,
                chunk=self.loss_chunk,
                temperature=rl.temperature,
                deterministic=not train,
                segments=inputs,
                positions=segment_positions(inputs),
            )

        def floats(field: int) -> jax.Array:  # (examples, seq_len): each target's value
            return jax.lax.bitcast_convert_type(rows[:, field, 1:], jnp.float32)

        policy = scored(model)
        logps = policy.logps  # (examples, seq_len)
        trained = target_weights(mask, segments)  # (examples, seq_len)
        old = floats(OLD_LOGPS) if rl.reuses_rollouts else jax.lax.stop_gradient(logps)
        ref = None
        if rl.beta > 0:
            frozen = self.reference_model(model, reference)
            assert isinstance(frozen, DecoderModel), type(frozen)
            ref = jax.lax.stop_gradient(scored(frozen).logps)
        advantages = jax.lax.bitcast_convert_type(rows[:, ADVANTAGE, 0], jnp.float32)
        terms = token_terms(rl.objective, logps, old, ref, advantages, trained)
        weights, metric = floats(LOSS_WEIGHT), floats(METRIC_WEIGHT)
        current = jax.lax.stop_gradient(logps)
        sampler = floats(SAMPLER_LOGPS)
        assert policy.entropies is not None
        values = {
            "entropy": jax.lax.stop_gradient(policy.entropies),
            "sampling/sampling_logp_difference/mean": jnp.abs(current - sampler),
            "sampling/importance_sampling_ratio/mean": jnp.exp(current - sampler),
            "kl": terms.kl,
        }
        sums = {
            name: jnp.sum(values[name] * metric * trained)
            for name in self.metric_names()
            if name in values
        }
        clip = floats(CLIP_WEIGHT)  # over tokens, or (GSPO) over sequences, empty ones too
        sums["clip_ratio/low_mean"] = jnp.sum(terms.low_clipped * clip)
        sums["clip_ratio/high_mean"] = jnp.sum(terms.high_clipped * clip)
        sums["clip_ratio/region_mean"] = jnp.sum(terms.region_clipped * clip)
        loss = TokenLoss(
            jnp.sum(terms.loss * weights * trained),
            jnp.asarray(rows.shape[0], jnp.int32),
            sums,
            jnp.sum(trained).astype(jnp.int32),
        )
        return with_routing(loss, policy.routing if train else None)

    def reference_model(self, model: nnx.Module, frozen: nnx.Module | None = None) -> nnx.Module:
        """The reference: the state's frozen copy of the starting parameters (``frozen``: full
        fine-tuning), else ``model`` with its LoRA adapters switched off."""
        if frozen is not None:
            return frozen
        assert self.config.finetune.lora_rank > 0, "the state's reference copy was not passed"
        return with_zero_adapters(model)

    def zero_loss(self) -> TokenLoss:
        zero, none = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        return TokenLoss(zero, none, {name: zero for name in self.metric_names()}, none)


def rl_trainer_class(family_trainer: type[FamilyTrainer]) -> type[RLTrainer]:
    """The RL trainer of ``family_trainer``'s family: its config adds ``rl``."""
    config_class = pydantic.create_model(
        f"{family_trainer.__name__}RLConfig",
        __base__=family_trainer.config_class,
        __module__=__name__,
        __doc__=f"{family_trainer.family.name} online RL: the family's sections and ``rl``.",
        rl=(RLSection, pydantic.Field(default_factory=RLSection)),
    )
    attributes = {
        "family": family_trainer.family,
        "config_class": config_class,
        "plan": family_trainer.plan,
        "__module__": __name__,
        "__doc__": f"Online RL of the {family_trainer.family.name} family's model.",
    }
    return type(f"{family_trainer.__name__}RL", (RLTrainer, family_trainer), attributes)
