"""The data of a run: its sources (one ``data.path`` or a weighted ``data.sources`` mixture),
each source's fixed held-out batches, and the global batch of each step, placed on the mesh."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from theseus.data import Mixture, MixtureSampler, load_mixture, validation_batches
from theseus.distributed.join import check_same_everywhere
from theseus.training.trainer import BaseTrainer


def load_data(trainer: BaseTrainer) -> Mixture:
    """The run's data: ``data.sources``, or ``data.path`` as a one-source mixture."""
    mixture = load_mixture(trainer.config.data)
    for source in mixture.sources:
        trainer.check_corpus(source.corpus)
    check_same_everywhere("corpus", mixture.fingerprint())
    return mixture


@dataclass(frozen=True)
class Validation:
    """Each source's held-out batches (sharded arrays) and weight; ``named`` sources report
    their losses one by one too."""

    batches: dict[str, jax.Array]
    weights: dict[str, float]
    named: bool

    def losses(self, trainer: BaseTrainer, params) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """The weighted mean validation loss, and each source's (None for a single data.path);
        on the device, not read."""
        by_source = {n: trainer.validation_step(params, b) for n, b in self.batches.items()}
        mean = sum(self.weights[name] * loss for name, loss in by_source.items())
        return mean, by_source if self.named else None


def validation_array(trainer: BaseTrainer, mixture: Mixture) -> Validation:
    """Each source's held-out batches as one sharded array (batches × accumulation, examples,
    seq_len + 1).

    Each held-out batch is ``training.batch_size`` examples split like a training batch, so the
    examples, and hence the loss, do not depend on the mesh.
    """
    plan = trainer.batch_plan
    num = trainer.config.training.validation_batches * plan.accumulation_steps
    arrays = {}
    for source in mixture.sources:
        try:
            batches = validation_batches(
                source.corpus.validation, plan.seq_len, num, plan.examples_per_microbatch
            )  # (num, examples, seq_len + 1)
        except ValueError as error:
            raise ValueError(f"data source {source.name!r}: {error}") from None
        arrays[source.name] = trainer.put_batch(
            lambda rows, batches=batches: batches[:, rows], batches.shape
        )
    weights = {source.name: source.weight for source in mixture.sources}
    return Validation(arrays, weights, mixture.named)


def train_batch(trainer: BaseTrainer, sampler: MixtureSampler, position: int) -> jax.Array:
    """The global batch of the step that starts at example ``position`` (each process reads only
    its devices' rows)."""
    plan = trainer.batch_plan
    return trainer.put_batch(
        lambda rows: sampler.local_batch(
            position, plan.accumulation_steps, plan.examples_per_microbatch, rows
        ),
        plan.shape,
    )
