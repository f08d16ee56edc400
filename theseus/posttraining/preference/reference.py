"""The precomputed reference of a preference run: each example's summed completion
log-probability under the model the run starts from (LoRA adapters off), computed in one pass
over every pair of the train and validation splits before training, on the training mesh and
layouts, and stored in the run directory (``reference_logps.npz``: per source and split,
(pairs, 2) float32, chosen then rejected, by pair index). A resumed run reads it back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

from theseus.accounting.preflight import BatchPlan
from theseus.data import Mixture
from theseus.data.pairs import PairRows, PairSampler, pair_examples
from theseus.data.sampler import VALIDATION_SEED
from theseus.distributed.join import is_main_process
from theseus.sharding.topology import UnderMesh
from theseus.training import gathering
from theseus.training.context import TrainerContext
from theseus.training.keys import Keys
from theseus.training.step import jitted_scoring_pass
from theseus.training.trainer import TrainerConfig


class PreferenceTrainer(Protocol):
    """What the pass reads of a preference trainer
    (:class:`~theseus.posttraining.preference.trainer.PreferenceTrainer`)."""

    @property
    def context(self) -> TrainerContext: ...

    @property
    def entry(self) -> gathering.Entry: ...

    @property
    def batch_plan(self) -> BatchPlan: ...

    @property
    def config(self) -> TrainerConfig: ...

    def put_batch(
        self, rows_for: Callable[[slice], np.ndarray], shape: tuple[int, ...]
    ) -> jax.Array: ...

    def reference_model(self, model: nnx.Module) -> nnx.Module: ...

    def reference_logps(self, reference: nnx.Module, rows: jax.Array, keys: Keys) -> jax.Array: ...

    @property
    def reference_step(self) -> UnderMesh: ...


REFERENCE_FILE = "reference_logps.npz"
_CHUNK = 16  # microbatches a call of the pass reads


def reference_step(trainer: PreferenceTrainer) -> UnderMesh:
    """Storage-layout parameters and (num, examples, PAIR_FIELDS, seq_len + 1) rows in, the
    reference's per-segment log-probabilities (num, examples, seq_len + 2) out, replicated."""

    def logps(model: nnx.Module, rows: jax.Array, keys: Keys) -> jax.Array:
        return trainer.reference_logps(trainer.reference_model(model), rows, keys)

    return jitted_scoring_pass(trainer.context, trainer.entry, logps)


def split_reference(trainer: PreferenceTrainer, sampler: PairSampler, params: Any) -> np.ndarray:
    """Every example's reference log-probability of one split: (examples,) float32."""
    step = trainer.reference_step
    examples = trainer.batch_plan.examples_per_microbatch
    packing = sampler.packing
    out = np.zeros(sampler.examples.lengths.size, np.float32)
    per_call = examples * _CHUNK
    for first in range(0, packing.num_rows, per_call):
        rows = np.arange(first, min(first + per_call, packing.num_rows))
        built = sampler.rows(rows)
        batch = np.zeros((per_call, *built.shape[1:]), np.int32)
        batch[: rows.size] = built  # empty rows after the last: no segments, nothing summed
        batch = batch.reshape(_CHUNK, examples, *built.shape[1:])
        sums = np.asarray(step(params, trainer.put_batch(_rows_of(batch), batch.shape)))
        sums = sums.reshape(per_call, -1)  # (rows, seq_len + 2)
        for place, row in enumerate(rows.tolist()):
            members = pair_examples(row, packing)  # segment s is members[s - 1]
            out[members] = sums[place, 1 : 1 + members.size]
    return out


def _rows_of(batch: np.ndarray):
    """The rows (examples) of ``batch`` (num, examples, ...) a device reads."""
    return lambda rows: batch[:, rows]


References = dict[tuple[str, int], np.ndarray]  # (source name, split) -> (examples,) float32
_FINGERPRINT = "data_fingerprint"


def computed(trainer: PreferenceTrainer, mixture: Mixture, params: Any) -> References:
    """Every example's reference log-probability, each source's train and validation split,
    under ``params`` (the reference model: :meth:`PreferenceTrainer.reference_logps`)."""
    seq_len, seed = trainer.batch_plan.seq_len, trainer.config.training.seed
    reference = {}
    for source in mixture.sources:
        for split in (0, 1):
            sampler = mixture.split_sampler(source, split, seq_len, (seed, VALIDATION_SEED)[split])
            reference[(source.name, split)] = split_reference(trainer, sampler, params)
    return reference


def stored(mixture: Mixture, run_dir: Path) -> References | None:
    """The references ``run_dir`` holds for ``mixture``'s data, or None when it holds none or
    holds another data's (its fingerprint differs)."""
    path = run_dir / REFERENCE_FILE
    if not path.is_file():
        return None
    with np.load(path) as held:
        if str(held[_FINGERPRINT]) != _fingerprint(mixture):
            return None
        return {
            (s.name, split): np.ascontiguousarray(held[_key(s.name, split)].reshape(-1), np.float32)
            for s in mixture.sources
            for split in (0, 1)
        }


def with_reference(
    trainer: PreferenceTrainer, mixture: Mixture, params: Any, run_dir: Path
) -> Mixture:
    """``mixture``'s pair rows carrying the reference: read from ``run_dir`` when it holds it
    (a resumed run), else computed from ``params`` (the run's start) and written there."""
    assert mixture.pairs is not None
    reference = stored(mixture, run_dir)
    if reference is None:
        if (run_dir / REFERENCE_FILE).is_file():
            raise ValueError(
                f"{run_dir / REFERENCE_FILE} holds the reference log-probabilities of other "
                "data than this run's (data.path or data.sources changed since they were "
                "computed); resume with the data the run started with, or start a new run "
                "(--overwrite)"
            )
        reference = computed(trainer, mixture, params)
        if is_main_process():
            arrays = {_key(name, split): v.reshape(-1, 2) for (name, split), v in reference.items()}
            arrays[_FINGERPRINT] = np.asarray(_fingerprint(mixture))
            np.savez(run_dir / REFERENCE_FILE, **arrays)  # type: ignore[arg-type]
    return mixture.with_pairs(PairRows(mixture.pairs.layout, reference))


def _key(source: str, split: int) -> str:
    return f"{source}/{('train', 'validation')[split]}"


def _fingerprint(mixture: Mixture) -> str:
    return json.dumps(mixture.fingerprint(), sort_keys=True)
