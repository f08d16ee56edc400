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

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from theseus.config import DataConfig
from theseus.data.packing import ROW_FIELDS, DocumentRows, Overlong, PackedSampler
from theseus.data.pairs import PAIR_FIELDS, PairRows, PairSampler
from theseus.data.preference import PREFERENCE_KIND
from theseus.data.sampler import VALIDATION_SEED, IndexedExamples, Sampler, validation_batches
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
    (metrics then carry ``val_loss_by_source``). When any source is a masked (chat or
    completion) corpus or ``document_masking`` is on, every source gives segmented rows
    (:mod:`theseus.data.packing`): ``segmented``."""

    sources: tuple[Source, ...]
    named: bool
    overlong: Overlong = "error"
    document_masking: bool = False
    pairs: PairRows | None = None  # masked sources read as preference pairs (theseus.data.pairs)
    _packed: dict = field(default_factory=dict, repr=False)  # packings made, by their inputs

    @property
    def vocab_size(self) -> int:
        return self.sources[0].corpus.vocab_size

    @property
    def tokenizer(self) -> Path | None:
        return self.sources[0].corpus.tokenizer

    @property
    def segmented(self) -> bool:
        return (
            self.document_masking
            or self.pairs is not None
            or any(s.corpus.examples is not None for s in self.sources)
        )

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

    def row_shape(self, seq_len: int) -> tuple[int, ...]:
        """The shape of one example of a batch: (seq_len + 1,), (ROW_FIELDS, seq_len + 1), or
        (PAIR_FIELDS, seq_len + 1) for pairs."""
        if self.pairs is not None:
            return (PAIR_FIELDS, seq_len + 1)
        return (ROW_FIELDS, seq_len + 1) if self.segmented else (seq_len + 1,)

    def split_sampler(self, source: Source, split: int, seq_len: int, seed: int):
        """``source``'s sampler of split ``split`` (0: train, 1: validation) in the mixture's
        row format: packed rows, windows split at end-of-text tokens, or plain windows."""
        if self.pairs is not None:
            return self._pair_sampler(source, split, seq_len, seed, self.pairs)
        corpus = source.corpus
        if corpus.pairs is not None:
            raise ValueError(
                f"{corpus.source} is a preference corpus (a chosen and a rejected reply to "
                "each prompt), which trains with a preference job, not as chat examples (that "
                "would train on the rejected replies too); run the model family's preference "
                "job, or tokenize conversations for supervised fine-tuning"
            )
        if corpus.examples is not None:
            key = (source.name, split, seq_len, seed)
            if key not in self._packed:  # packed once: the run, run.json and validation share it
                where = f"the {('train', 'validation')[split]} split of {corpus.source}"
                examples = corpus.examples[split]
                self._packed[key] = PackedSampler(examples, seq_len, seed, self.overlong, where)
            return self._packed[key]
        windows = Sampler((corpus.train, corpus.validation)[split], seq_len, seed)
        if not self.segmented:
            return windows
        return DocumentRows(windows, corpus.eos_id if self.document_masking else None)

    def _pair_sampler(
        self, source: Source, split: int, seq_len: int, seed: int, pairs: PairRows
    ) -> PairSampler:
        """``source``'s pair rows of split ``split``, read from its corpus's preference pairs
        (:mod:`theseus.data.preference`); a corpus without pairs is refused."""
        corpus = source.corpus
        where = f"the {('train', 'validation')[split]} split of {corpus.source}"
        if corpus.pairs is None:
            kind = "a token stream" if corpus.examples is None else "a chat corpus"
            raise ValueError(
                f"{where} is {kind}, not a preference corpus, but preference tuning reads pairs "
                "(a chosen and a rejected reply to each prompt; the manifest's kind "
                f"{PREFERENCE_KIND!r}): tokenize records with 'chosen' and 'rejected' (and a "
                "'prompt') with `theseus tokenize` and give that folder as data.path or "
                "data.sources, or train on this corpus with the family's train/pretrain job"
            )
        key = (source.name, split, seq_len, seed)
        if key not in self._packed:
            reference = pairs.reference.get((source.name, split))
            self._packed[key] = PairSampler(
                corpus.pairs[split].examples, seq_len, seed, self.overlong, pairs.layout, where,
                reference,
            )  # fmt: skip
        return self._packed[key]

    def with_pairs(self, pairs: PairRows) -> Mixture:
        """This mixture read as preference pairs laid out and referenced as ``pairs`` says."""
        return replace(self, pairs=pairs, _packed={})

    def sampler(self, seq_len: int, seed: int) -> MixtureSampler:
        samplers = [self.split_sampler(s, 0, seq_len, seed) for s in self.sources]
        return MixtureSampler(samplers, self.weights, seed)

    def validation(self, source: Source, seq_len: int, num_batches: int, examples: int):
        """``source``'s fixed held-out batches (num_batches, examples, *row_shape): examples
        ``0 ..`` of its validation sampler under ``VALIDATION_SEED`` (see
        :func:`~theseus.data.sampler.validation_batches`)."""
        if not self.segmented:
            return validation_batches(source.corpus.validation, seq_len, num_batches, examples)
        sampler = self.split_sampler(source, 1, seq_len, VALIDATION_SEED)
        if sampler.num_windows < examples:
            raise ValueError(
                f"the validation split of {source.corpus.source} packs into "
                f"{sampler.num_windows} rows of seq_len + 1 = {seq_len + 1} tokens, but one "
                f"validation batch needs {examples}; lower the batch size or sequence length, "
                "or hold out more examples"
            )
        return sampler.global_batch(0, num_batches, examples)

    def packing_facts(self, seq_len: int, seed: int) -> dict | None:
        """Each masked source's packing (rows, efficiency, overlong examples) of both splits,
        for run.json; None when no source is packed."""
        facts = {}
        for source in self.sources:
            if source.corpus.examples is None:
                continue
            train = self.split_sampler(source, 0, seq_len, seed).packing
            validation = self.split_sampler(source, 1, seq_len, VALIDATION_SEED).packing
            facts[source.name] = {"train": train.facts(), "validation": validation.facts()}
        return facts or None

    @property
    def weights(self) -> np.ndarray:
        return np.asarray([s.weight for s in self.sources])  # (sources,)


def load_mixture(data: DataConfig) -> Mixture:
    """The sources of ``data``: ``data.sources``, or ``data.path`` (None: built-in) as one."""
    options: dict[str, Any] = {
        "validation_fraction": data.validation_fraction,
        "token_dtype": data.token_dtype,
        "text_field": data.text_field,
    }
    if data.sources is None:
        sources = [Source("data", 1.0, load_corpus(data.path, **options))]
    else:
        total = sum(s.weight for s in data.sources)
        sources = []
        for given in data.sources:
            try:
                corpus = load_corpus(given.path, **options)
            except ValueError as error:
                raise ValueError(f"data source {given.name!r}: {error}") from None
            name = given.name or given.path  # named by the config's validator
            sources.append(Source(name, given.weight / total, corpus))
        _check_same_vocabulary(sources)
    if data.document_masking:
        _check_end_of_text(sources)
    named = data.sources is not None
    return Mixture(tuple(sources), named, data.overlong, data.document_masking)


class MixtureSampler(IndexedExamples):
    """Maps global example indices to rows of the mixture's train splits (the
    :class:`~theseus.data.sampler.Sampler` interface); each source's ``sampler`` gives rows of
    the mixture's one format."""

    def __init__(self, samplers: list[IndexedExamples], weights: np.ndarray, seed: int):
        self.samplers = samplers
        self.cumulative = np.cumsum(weights) / np.sum(weights)  # (sources,)
        self.seed = seed

    def sources(self, indices: np.ndarray) -> np.ndarray:
        """The source of each global example index, int64 of ``indices.shape``."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(self.samplers) == 1:
            return np.zeros(indices.shape, np.int64)
        drawn = np.searchsorted(self.cumulative, uniform(self.seed, indices), side="right")
        return np.minimum(drawn, len(self.samplers) - 1)

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Rows at global ``indices``, int32 of shape indices.shape + the row shape."""
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)  # (n,)
        if len(self.samplers) == 1:
            return self.samplers[0].gather(indices)
        sources = self.sources(flat)  # (n,)
        parts = {
            number: sampler.gather(flat[sources == number])
            for number, sampler in enumerate(self.samplers)
            if (sources == number).any()
        }
        row_shape = next(iter(parts.values())).shape[1:]
        examples = np.empty((flat.size, *row_shape), np.int32)  # (n, *row_shape)
        for number, part in parts.items():
            examples[sources == number] = part
        return examples.reshape(*np.shape(indices), *row_shape)


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
        ours, theirs = first.corpus.tokenizer, other.corpus.tokenizer
        same_tokenizer = (ours is None and theirs is None) or (
            ours is not None and theirs is not None and ours.read_bytes() == theirs.read_bytes()
        )
        if first.corpus.vocab_size != other.corpus.vocab_size or not same_tokenizer:
            raise ValueError(
                f"data sources {first.name!r} ({first.corpus.source}) and {other.name!r} "
                f"({other.corpus.source}) are in different token ids (vocabularies "
                f"{first.corpus.vocab_size} and {other.corpus.vocab_size}, or other tokenizers); "
                "tokenize every source with the same tokenizer (--tokenizer) or use byte sources"
            )


def _check_end_of_text(sources: list[Source]) -> None:
    """Document masking splits a stream at its end-of-text tokens: a corpus must have one."""
    for source in sources:
        corpus = source.corpus
        if corpus.eos_id is None and corpus.examples is None:
            raise ValueError(
                f"data.document_masking=true splits documents at the end-of-text token, but "
                f"{corpus.source} has none (byte corpora and .bin files do not record one); "
                "tokenize the corpus with `theseus tokenize` or set data.document_masking=false"
            )
