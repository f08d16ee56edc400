"""Preference tuning of a model family (``NAME/train/preference``): the family's trainer reading
pair rows (:mod:`theseus.data.pairs`) and adding up a preference loss
(:mod:`theseus.posttraining.preference.objective`) per pair.

``training.batch_size`` counts rows: one pair each under ``preference.layout=padded``, as many
whole pairs as fit under ``packed`` (the default). The loss is the mean over the pairs of the
global batch (a sum and a count, as next-token losses are a sum over tokens and their count), so
no layout, accumulation or packing changes it. The reference is the model the run starts from;
for a LoRA run the same parameters with the adapters switched off, so no second copy is held.
``precomputed`` (the default) computes it once before training
(:mod:`theseus.posttraining.preference.reference`), ``live`` in every step: from the base with
the adapters off (LoRA), or from a frozen copy of the starting parameters that the state holds
beside the trained ones (full fine-tuning: the one setting that holds a second copy).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

from theseus.data import Mixture
from theseus.data.pairs import PairLayout, PairRows
from theseus.model.lora import with_zero_adapters
from theseus.posttraining.preference import reference
from theseus.posttraining.preference.objective import METRICS, PreferenceConfig, pair_losses
from theseus.posttraining.preference.rows import (
    completion_logps,
    reference_pairs,
    row_pairs,
    stored_reference,
)
from theseus.sharding.topology import UnderMesh
from theseus.training.family import FamilyTrainer
from theseus.training.keys import Keys
from theseus.training.losses import TokenLoss, with_routing


class PreferenceSection(PreferenceConfig):
    """The ``preference`` section: the loss's settings and how pairs are laid out in rows."""

    layout: PairLayout = pydantic.Field(
        "packed", description="packed: whole pairs packed into rows; padded: one pair a row"
    )


class PreferenceTrainer(FamilyTrainer):
    """A family's trainer on preference pairs (subclassed per family:
    :func:`preference_trainer_class`)."""

    @property
    def preference(self) -> PreferenceSection:
        return self.config.preference  # type: ignore[attr-defined]

    @property
    def holds_reference(self) -> bool:
        """The live reference of a full fine-tuning run is a frozen copy of the starting
        parameters in the state (a LoRA run's is the base with the adapters off: no copy)."""
        return self.preference.reference_mode == "live" and self.config.finetune.lora_rank == 0

    def rows_of(self, mixture: Mixture) -> Mixture:
        """The mixture's masked sources as pair rows (no reference yet)."""
        return mixture.with_pairs(PairRows(self.preference.layout, {}))

    def with_reference(self, mixture: Mixture, params: Any, run_dir: Path) -> Mixture:
        """With ``preference.reference=precomputed``: the pair rows carrying the reference
        (:func:`theseus.posttraining.preference.reference.with_reference`)."""
        if self.preference.reference_mode != "precomputed":
            return mixture
        return reference.with_reference(self, mixture, params, run_dir)

    def for_evaluation(self, mixture: Mixture, params: Any, run_dir: Path) -> Mixture:
        """The pair rows of ``theseus evaluate``: the reference the run stored when the data is
        the run's own, else (other pairs) computed from ``params`` with the adapters off, which
        is the reference of a LoRA run; a full fine-tuning run's reference is no longer held,
        unless its checkpoints hold the live reference's copy (then the rows need none)."""
        if self.preference.reference_mode is None or self.holds_reference:
            return mixture
        references = reference.stored(mixture, run_dir)
        if references is None and self.config.finetune.lora_rank == 0:
            raise ValueError(
                f"evaluating {run_dir} on other pairs than its own needs their reference "
                "log-probabilities under the model it started from, which a full fine-tuning "
                "run no longer holds; evaluate on the run's data, or on a LoRA run (its "
                "reference is the base with the adapters off)"
            )
        if references is None:
            references = reference.computed(self, mixture, params)
        assert mixture.pairs is not None
        return mixture.with_pairs(PairRows(mixture.pairs.layout, references))

    @cached_property
    def reference_step(self) -> UnderMesh:
        """The jitted reference pass
        (:func:`theseus.posttraining.preference.reference.reference_step`)."""
        return reference.reference_step(self)

    def reference_model(self, model: nnx.Module, frozen: nnx.Module | None = None) -> nnx.Module:
        """The reference: the model of the state's frozen copy of the starting parameters
        (``frozen``: full fine-tuning, live), else ``model`` itself (the starting parameters)
        or ``model`` with its LoRA adapters switched off (zeroed; the other parameters are the
        same arrays, gathered as the policy's are)."""
        if frozen is not None:
            return frozen
        assert not self.holds_reference, "the state's reference copy was not passed"
        if self.config.finetune.lora_rank == 0:
            return model
        return with_zero_adapters(model)

    def reference_logps(self, reference: nnx.Module, rows: jax.Array, keys: Keys) -> jax.Array:
        """Per row and segment, the summed completion log-probabilities (examples, seq_len + 2)
        of the ``reference`` model (:meth:`reference_model`), without gradient."""
        scored = self.target_logps(reference, rows, keys, train=False)
        return jax.lax.stop_gradient(completion_logps(scored.logps, rows).sums)

    def token_loss(
        self,
        model: nnx.Module,
        rows: jax.Array,
        keys: Keys,
        *,
        train: bool,
        reference: nnx.Module | None = None,
    ) -> TokenLoss:
        """The summed preference loss of the pairs of pair rows (examples, PAIR_FIELDS,
        seq_len + 1), their number, the summed metrics and the trained tokens; in training, a
        model with experts adds its routing loss, weighted by the pairs. ``reference``: the
        model of the state's frozen copy (full fine-tuning with the live reference). Plain
        token rows (the FLOP count's and the gather trace's) get the next-token loss."""
        if rows.ndim == 2:
            return super().token_loss(model, rows, keys, train=train)
        policy = self.target_logps(model, rows, keys, train=train)
        logps = completion_logps(policy.logps, rows)
        pairs = row_pairs(logps, rows)
        preference = self.preference
        references = None
        if preference.reference_mode == "live":
            live = self.reference_model(model, reference)
            references = reference_pairs(self.reference_logps(live, rows, keys), pairs)
        elif preference.reference_mode == "precomputed":
            references = reference_pairs(stored_reference(rows), pairs)
        scored = pair_losses(preference, pairs.policy, references)
        valid = pairs.valid
        loss = TokenLoss(
            jnp.sum(scored.loss * valid),
            jnp.sum(valid).astype(jnp.int32),
            scored.metric_sums(valid),
            jnp.sum(logps.tokens[:, 1:]).astype(jnp.int32),
        )
        return with_routing(loss, policy.routing if train else None)

    def zero_loss(self) -> TokenLoss:
        zero, none = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        return TokenLoss(zero, none, {name: zero for name in METRICS}, none)


def preference_trainer_class(family_trainer: type[FamilyTrainer]) -> type[PreferenceTrainer]:
    """The preference trainer of ``family_trainer``'s family: its config adds ``preference``."""
    config_class = pydantic.create_model(
        f"{family_trainer.__name__}PreferenceConfig",
        __base__=family_trainer.config_class,
        __module__=__name__,
        __doc__=f"{family_trainer.family.name} preference tuning: the family's sections and "
        "``preference``.",
        preference=(PreferenceSection, pydantic.Field(default_factory=PreferenceSection)),
    )
    attributes = {
        "family": family_trainer.family,
        "config_class": config_class,
        "plan": family_trainer.plan,
        "__module__": __name__,
        "__doc__": f"Preference tuning of the {family_trainer.family.name} family's model.",
    }
    name = f"{family_trainer.__name__}Preference"
    return type(name, (PreferenceTrainer, family_trainer), attributes)
