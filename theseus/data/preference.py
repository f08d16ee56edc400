"""The pairs of a tokenized preference corpus, as a preference trainer reads them.

A preference corpus is a masked corpus (:mod:`theseus.data.shards`) whose manifest says
``"kind": "preference"``: in each split, pair ``i`` is examples ``2i`` (chosen) and ``2i + 1``
(rejected), each the tokens of its prompt and completion, with a mask that is 1 exactly on the
completion tokens (TRL's ``DPOTrainer`` completion: the tokens after the point where the
tokenized prompt and the tokenized prompt plus completion diverge). Both examples of a pair
begin with the same prompt tokens, so the mask's zeros are the prompt.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from theseus.data.packing import MaskedExamples
from theseus.data.shards import (
    Manifest,
    ShardedTokens,
    example_lengths,
    open_masks,
    open_split,
    read_manifest,
)

PREFERENCE_KIND = "preference"  # the manifest's "kind" of a preference corpus
_BLOCK = 2**22  # mask values summed at a time (bounded memory over a memory-mapped split)


@dataclass(frozen=True)
class PreferencePair:
    """One pair of a split: its chosen and rejected examples and its number in the split."""

    chosen_ids: np.ndarray  # (chosen tokens,) int32
    chosen_mask: np.ndarray  # (chosen tokens,) uint8, 1 on the completion tokens
    rejected_ids: np.ndarray  # (rejected tokens,) int32
    rejected_mask: np.ndarray  # (rejected tokens,) uint8
    index: int


@dataclass(frozen=True)
class PreferencePairs:
    """A split's pairs, read from its memory-mapped examples (nothing is read until asked)."""

    examples: MaskedExamples  # (2 * pairs examples): chosen and rejected of each pair in turn

    def __len__(self) -> int:
        return self.examples.lengths.size // 2

    def __getitem__(self, index: int) -> PreferencePair:
        if not 0 <= index < len(self):
            raise IndexError(f"pair {index} out of range [0, {len(self)})")
        chosen, rejected = (self._example(2 * index + side) for side in (0, 1))
        return PreferencePair(*chosen, *rejected, index)

    def __iter__(self) -> Iterator[PreferencePair]:
        return (self[index] for index in range(len(self)))

    def _example(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        begin = int(self.examples.starts[number])
        span = slice(begin, begin + int(self.examples.lengths[number]))
        ids = np.asarray(self.examples.tokens[span], np.int32)
        return ids, np.asarray(self.examples.mask[span], np.uint8)

    @cached_property
    def lengths(self) -> np.ndarray:
        """(pairs, 2) int64: tokens of each pair's chosen and rejected example."""
        return self.examples.lengths.reshape(-1, 2)

    @cached_property
    def completion_lengths(self) -> np.ndarray:
        """(pairs, 2) int64: completion tokens (mask ones) of each side, one pass over the
        split's mask."""
        return _ones_per_example(self.examples.mask, self.examples.lengths).reshape(-1, 2)

    @cached_property
    def prompt_lengths(self) -> np.ndarray:
        """(pairs,) int64: each pair's prompt tokens (the same on both sides)."""
        return (self.lengths - self.completion_lengths)[:, 0]


def is_preference(manifest: Manifest) -> bool:
    """Whether a tokenized folder's manifest is a preference corpus's."""
    return manifest.data.get("kind") == PREFERENCE_KIND


def load_pairs(folder: str | os.PathLike, split: str) -> PreferencePairs:
    """The pairs of split ``split`` ("train" or "validation") of the preference corpus that
    ``theseus tokenize`` wrote in ``folder``."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if not is_preference(manifest):
        raise ValueError(
            f'{folder} is not a preference corpus (its manifest has no "kind": '
            f"{PREFERENCE_KIND!r}); tokenize records with 'chosen' and 'rejected' into it"
        )
    return pairs_of(
        MaskedExamples(
            open_split(folder, manifest, split),
            open_masks(folder, manifest, split),
            example_lengths(folder, manifest, split),
        ),
        f"the {split} split of {folder}",
    )


def pairs_of(examples: MaskedExamples, where: str) -> PreferencePairs:
    """A preference corpus split's examples as pairs (their number must be even)."""
    if examples.lengths.size % 2:
        raise ValueError(
            f"{where} holds {examples.lengths.size} examples, not pairs; tokenize it again"
        )
    return PreferencePairs(examples)


def _ones_per_example(mask: np.ndarray | ShardedTokens, lengths: np.ndarray) -> np.ndarray:
    """(examples,) int64: the ones of ``mask`` in each example, read ``_BLOCK`` at a time."""
    ends = np.cumsum(lengths)  # (examples,) where each example ends
    before_end = np.empty(ends.size, np.int64)  # ones of the mask before each example's end
    carry = done = 0
    for begin in range(0, int(ends[-1]) if ends.size else 0, _BLOCK):
        stop = min(begin + _BLOCK, int(ends[-1]))
        running = np.cumsum(np.asarray(mask[begin:stop]), dtype=np.int64) + carry  # (block,)
        last = int(np.searchsorted(ends, stop, side="right"))
        before_end[done:last] = running[ends[done:last] - 1 - begin]
        carry, done = int(running[-1]), last
    return np.diff(before_end, prepend=0)
