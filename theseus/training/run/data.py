"""The data of a run: its sources (one ``data.path`` or a weighted ``data.sources`` mixture),
each source's fixed held-out batches, and the global batch of each step, placed on the mesh."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from theseus.data import Mixture, MixtureSampler, load_mixture
from theseus.distributed.join import check_same_everywhere
from theseus.training.state import TrainState
from theseus.training.trainer import BaseTrainer


@dataclass(frozen=True)
class StepBatch:
    """A step's global batch (sharded) and what making it measured on the host (an RL
    step's rewards and completion lengths; none for a corpus), for the step's row."""

    rows: jax.Array
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Validated:
    """A validation pass: the mean loss (None where the data has none: RL's held-out prompts
    are scored by their rewards), each source's (None for one source), and the other metrics,
    on the device or the host, not read yet."""

    loss: jax.Array | None
    by_source: dict[str, jax.Array] | None
    means: dict[str, Any]


class RunData(Protocol):
    """What the training loop reads: the batch of each step and the held-out data's scores.
    A corpus (:class:`CorpusData`) or RL's prompts and their rollouts."""

    @property
    def description(self) -> str: ...

    @property
    def tokenizer(self) -> Path | None: ...  # copied into the run (None: none)

    def facts(self) -> dict[str, Any]: ...  # run.json's entries on the data

    def batch_shape(self) -> tuple[int, ...]: ...  # (accumulation, examples, *row shape)

    def prepared(self, params: Any, run_dir: Path) -> RunData: ...  # from the start's params

    def batch(self, step: int, position: int, state: TrainState) -> StepBatch: ...

    def validate(self, params: Any, reference: Any = None) -> Validated: ...  # storage layout


def load_data(trainer: BaseTrainer) -> Mixture:
    """The run's data: ``data.sources``, or ``data.path`` as a one-source mixture."""
    mixture = trainer.rows_of(load_mixture(trainer.config.data))
    for source in mixture.sources:
        trainer.check_corpus(source.corpus)
    if mixture.segmented and type(trainer).token_loss is BaseTrainer.token_loss:
        raise ValueError(
            f"{type(trainer).__name__} trains on plain token rows, but the data "
            f"({mixture.description}) gives segmented rows (a chat corpus's packed examples, or "
            "data.document_masking=true); train it with a model family's trainer, or define "
            "token_loss for segmented rows"
        )
    check_same_everywhere("corpus", mixture.fingerprint())
    return mixture


@dataclass(frozen=True)
class Validation:
    """Each source's held-out batches (sharded arrays) and weight; ``named`` sources report
    their losses one by one too."""

    batches: dict[str, jax.Array]
    weights: dict[str, float]
    named: bool

    def losses(
        self, trainer: BaseTrainer, params, reference=None
    ) -> tuple[jax.Array, dict[str, jax.Array] | None, dict[str, jax.Array]]:
        """The weighted mean validation loss, each source's (None for a single data.path), and
        the loss's other metrics weighted alike (a preference loss's rewards; none for a
        next-token loss), of ``params`` and the state's ``reference`` copy (where it holds one);
        on the device, not read."""
        held = () if reference is None else (reference,)
        by_source = {n: trainer.validation_step(params, b, *held) for n, b in self.batches.items()}
        means: dict[str, jax.Array] = {}
        for name, values in by_source.items():
            for key, value in values.items():
                means[key] = means.get(key, jnp.zeros(())) + self.weights[name] * value
        losses = {name: values["loss"] for name, values in by_source.items()}
        mean = means.pop("loss")
        return mean, losses if self.named else None, means


def validation_array(trainer: BaseTrainer, mixture: Mixture) -> Validation:
    """Each source's held-out batches as one sharded array (batches × accumulation, examples,
    *row shape).

    Each held-out batch is ``training.batch_size`` examples split like a training batch, so the
    examples, and hence the loss, do not depend on the mesh.
    """
    plan = trainer.batch_plan
    num = trainer.config.training.validation_batches * plan.accumulation_steps
    arrays = {}
    for source in mixture.sources:
        try:
            batches = mixture.validation(
                source, plan.seq_len, num, plan.examples_per_microbatch
            )  # (num, examples, *row shape)
        except ValueError as error:
            raise ValueError(f"data source {source.name!r}: {error}") from None
        arrays[source.name] = trainer.put_batch(_rows_of(batches), batches.shape)
    weights = {source.name: source.weight for source in mixture.sources}
    return Validation(arrays, weights, mixture.named)


def batch_shape(trainer: BaseTrainer, mixture: Mixture) -> tuple[int, ...]:
    """The shape of a global batch of ``mixture``'s rows: (accumulation, examples, *row shape)."""
    plan = trainer.batch_plan
    return (*plan.shape[:2], *mixture.row_shape(plan.seq_len))


def train_batch(
    trainer: BaseTrainer, sampler: MixtureSampler, position: int, shape: tuple[int, ...]
) -> jax.Array:
    """The global batch of ``shape`` of the step that starts at example ``position`` (each
    process reads only its devices' rows)."""
    plan = trainer.batch_plan
    return trainer.put_batch(
        lambda rows: sampler.local_batch(
            position, plan.accumulation_steps, plan.examples_per_microbatch, rows
        ),
        shape,
    )


@dataclass(frozen=True)
class CorpusData:
    """A run's corpus (one ``data.path`` or a mixture) as the loop reads it: each step's batch
    drawn by position (made while the step before runs: it needs no state), and the
    validation loss of the held-out batches."""

    trainer: BaseTrainer
    mixture: Mixture
    validation: Validation
    sampler: MixtureSampler

    @classmethod
    def of(cls, trainer: BaseTrainer, mixture: Mixture | None = None) -> CorpusData:
        """The run's data (loaded and checked when not given: an error writes nothing)."""
        mixture = load_data(trainer) if mixture is None else mixture
        config = trainer.config.training
        sampler = mixture.sampler(trainer.batch_plan.seq_len, config.seed)
        return cls(trainer, mixture, validation_array(trainer, mixture), sampler)

    @property
    def description(self) -> str:
        return self.mixture.description

    @property
    def tokenizer(self) -> Path | None:
        return self.mixture.tokenizer

    def facts(self) -> dict[str, Any]:
        return data_facts(self.trainer, self.mixture)

    def batch_shape(self) -> tuple[int, ...]:
        return batch_shape(self.trainer, self.mixture)

    def prepared(self, params: Any, run_dir: Path) -> CorpusData:
        """With what the loss needs from the starting ``params`` (a preference run's reference
        log-probabilities), which the held-out rows carry too."""
        mixture = self.trainer.with_reference(self.mixture, params, run_dir)
        return self if mixture is self.mixture else CorpusData.of(self.trainer, mixture)

    def batch(self, step: int, position: int, state: TrainState) -> StepBatch:
        del step, state  # a corpus's batches follow from the position alone
        return StepBatch(train_batch(self.trainer, self.sampler, position, self.batch_shape()))

    def validate(self, params: Any, reference: Any = None) -> Validated:
        """The held-out batches' loss of ``params`` (and the state's ``reference`` copy,
        where it holds one)."""
        loss, by_source, means = self.validation.losses(self.trainer, params, reference)
        return Validated(loss, by_source, means)


def _rows_of(batches: np.ndarray) -> Callable[[slice], np.ndarray]:
    """The rows (examples) of every batch of ``batches`` (num, examples, ...) a device reads."""
    return lambda rows: batches[:, rows]


def data_facts(trainer: BaseTrainer, mixture: Mixture) -> dict[str, Any]:
    """run.json's entries on the rows: whether they are segmented, and for masked sources how
    they packed (rows, non-padding fraction, examples truncated or dropped by data.overlong)."""
    if not mixture.segmented:
        return {"segmented_rows": False}
    seq_len, seed = trainer.batch_plan.seq_len, trainer.config.training.seed
    facts: dict[str, Any] = {"segmented_rows": True, "document_masking": mixture.document_masking}
    packing = mixture.packing_facts(seq_len, seed)
    if packing is not None:
        facts |= {"overlong": mixture.overlong, "packing": packing}
    return facts
