"""Weighted mixtures of corpora: ``data.sources=PATH_A:0.7,PATH_B:0.3``.

Global example ``i`` comes from source ``s(i)``, drawn from the normalised weights by a
counter-based hash of ``(seed, i)`` (splitmix64), and is that source's example ``i`` (its
stateless :class:`~theseus.data.sampler.Sampler`). So each position of each step's global batch
draws its source and window from (seed, step, index) alone: every policy, accumulation count and
process count sees the same examples, and a resumed run, which passes back the data position,
goes on exactly. A single ``data.path`` is a one-source mixture that never draws, so it samples as
before. Validation holds out each source's own fixed set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from theseus.config import DataConfig
from theseus.data.sampler import IndexedExamples, Sampler
from theseus.data.tokens import Corpus, load_corpus

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = 0x6D1F  # keeps the source draws apart from other uses of the seed


@dataclass(frozen=True, eq=False)
class Source:
    """One corpus of a mixture, its name and its weight (normalised over the mixture)."""

    name: str
    weight: float
    corpus: Corpus


@dataclass(frozen=True, eq=False)
class Mixture:
    """The sources a run trains on. ``named`` says whether they were given as ``data.sources``
    (metrics then carry ``val_loss_by_source``)."""

    sources: tuple[Source, ...]
    named: bool

    @property
    def vocab_size(self) -> int:
        return self.sources[0].corpus.vocab_size

    @property
    def tokenizer(self) -> Path | None:
        return self.sources[0].corpus.tokenizer

    @property
    def description(self) -> str:
        if not self.named:
            return self.sources[0].corpus.source
        return "; ".join(f"{s.name} ({s.weight:.3g}): {s.corpus.source}" for s in self.sources)

    def fingerprint(self) -> dict[str, int]:
        """Every source's corpus fingerprint (small integers, keys prefixed by the source's name
        in a mixture): equal on every process that reads the same data."""
        if not self.named:
            return self.sources[0].corpus.fingerprint()
        return {
            f"{s.name}: {key}": value
            for s in self.sources
            for key, value in s.corpus.fingerprint().items()
        }

    def sampler(self, seq_len: int, seed: int) -> MixtureSampler:
        return MixtureSampler([s.corpus.train for s in self.sources], self.weights, seq_len, seed)

    @property
    def weights(self) -> np.ndarray:
        return np.asarray([s.weight for s in self.sources])  # (sources,)


def load_mixture(data: DataConfig) -> Mixture:
    """The sources of ``data``: ``data.sources``, or ``data.path`` (None: built-in) as one."""
    options = {
        "validation_fraction": data.validation_fraction,
        "token_dtype": data.token_dtype,
        "text_field": data.text_field,
    }
    if data.sources is None:
        return Mixture((Source("data", 1.0, load_corpus(data.path, **options)),), named=False)
    total = sum(s.weight for s in data.sources)
    sources = []
    for given in data.sources:
        try:
            corpus = load_corpus(given.path, **options)
        except ValueError as error:
            raise ValueError(f"data source {given.name!r}: {error}") from None
        sources.append(Source(given.name, given.weight / total, corpus))
    _check_same_vocabulary(sources)
    return Mixture(tuple(sources), named=True)


class MixtureSampler(IndexedExamples):
    """Maps global example indices to token windows of the mixture's train splits (the
    :class:`~theseus.data.sampler.Sampler` interface)."""

    def __init__(self, tokens: list, weights: np.ndarray, seq_len: int, seed: int):
        self.samplers = [Sampler(t, seq_len, seed) for t in tokens]
        self.cumulative = np.cumsum(weights) / np.sum(weights)  # (sources,)
        self.seq_len = seq_len
        self.seed = seed

    def sources(self, indices: np.ndarray) -> np.ndarray:
        """The source of each global example index, int64 of ``indices.shape``."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(self.samplers) == 1:
            return np.zeros(indices.shape, np.int64)
        drawn = np.searchsorted(self.cumulative, uniform(self.seed, indices), side="right")
        return np.minimum(drawn, len(self.samplers) - 1)

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Examples at global ``indices``, int32 of shape indices.shape + (seq_len + 1,)."""
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)  # (n,)
        if len(self.samplers) == 1:
            return self.samplers[0].gather(indices)
        sources = self.sources(flat)  # (n,)
        examples = np.empty((flat.size, self.seq_len + 1), np.int32)  # (n, seq_len + 1)
        for number, sampler in enumerate(self.samplers):
            chosen = sources == number
            if chosen.any():
                examples[chosen] = sampler.gather(flat[chosen])
        return examples.reshape(*np.shape(indices), self.seq_len + 1)


def uniform(seed: int, indices: np.ndarray) -> np.ndarray:
    """A float64 in [0, 1) for each index: splitmix64 of ``(seed, index)``, 53 bits."""
    with np.errstate(over="ignore"):
        key = _mix(np.asarray([seed * 0x10000 + _SALT], np.uint64))[0]
        state = np.asarray(indices, np.int64).astype(np.uint64) * _GOLDEN + key
        return (_mix(state) >> np.uint64(11)).astype(np.float64) / 2.0**53


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _check_same_vocabulary(sources: list[Source]) -> None:
    """Every source must be in the same token ids: the same vocabulary and tokenizer."""
    first = sources[0]
    for other in sources[1:]:
        same_tokenizer = (first.corpus.tokenizer is None) == (other.corpus.tokenizer is None) and (
            first.corpus.tokenizer is None
            or first.corpus.tokenizer.read_bytes() == other.corpus.tokenizer.read_bytes()
        )
        if first.corpus.vocab_size != other.corpus.vocab_size or not same_tokenizer:
            raise ValueError(
                f"data sources {first.name!r} ({first.corpus.source}) and {other.name!r} "
                f"({other.corpus.source}) are in different token ids (vocabularies "
                f"{first.corpus.vocab_size} and {other.corpus.vocab_size}, or other tokenizers); "
                "tokenize every source with the same tokenizer (--tokenizer) or use byte sources"
            )
