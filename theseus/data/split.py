"""The three train/validation splits: by document position (folders and document files), by
file name (the built-in corpus) and the tail (a single text or ``.bin`` file).

Which documents are held out for validation: a seeded, balanced split by document position.

Documents are taken in blocks of ``BLOCK`` consecutive positions; block ``b`` holds
``round((b + 1) * BLOCK * f) - round(b * BLOCK * f)`` validation documents, the ones that a
seeded permutation of the block (``np.random.default_rng([seed, b, SALT])``) ranks first. So
every full block is within one document of the requested fraction ``f`` and the whole corpus
within one document plus a part block: unlike a hash of each document on its own, whose share
wanders by ``sqrt(f (1 - f) / n)``. The decision needs only the position, never the corpus
size, so a stream can split as it reads. Document 0 always goes to validation and document 1
to train, so any corpus of two or more documents has both splits.

``theseus tokenize`` and the byte loader split the same way (a folder's files are its
documents), so validation losses compare in nats per byte.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

BLOCK = 100
SALT = 0x5EED  # keeps these permutations apart from the sampler's, which use [seed, epoch]


class DocumentSplit:
    """``is_validation(position)`` for document positions read in any order (the permutation of
    the last block asked about is cached, so in-order reading costs one permutation per block)."""

    def __init__(self, fraction: float, seed: int):
        if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(
                f"validation_fraction must be strictly between 0 and 1, got {fraction!r}"
            )
        self.fraction = float(fraction)
        self.seed = int(seed)
        self._block = -1
        self._ranks = np.empty(0, np.int64)

    def is_validation(self, position: int) -> bool:
        block, offset = divmod(position, BLOCK)
        return bool(self._block_ranks(block)[offset] < self._quota(block))

    def _quota(self, block: int) -> int:
        quota = _round(BLOCK * self.fraction * (block + 1)) - _round(BLOCK * self.fraction * block)
        return min(max(quota, 1), BLOCK - 1) if block == 0 else quota

    def _block_ranks(self, block: int) -> np.ndarray:
        """Each position's rank within its block: the first ``quota`` ranks are validation."""
        if block != self._block:
            ranks = np.random.default_rng([self.seed, block, SALT]).permutation(BLOCK)  # (BLOCK,)
            if block == 0:  # document 0 to validation, document 1 to train
                for position, rank in ((0, 0), (1, BLOCK - 1)):
                    other = int(np.flatnonzero(ranks == rank)[0])
                    ranks[other], ranks[position] = ranks[position], rank
            self._block, self._ranks = block, ranks
        return self._ranks


def _round(value: float) -> int:
    """Round half up (Python's ``round`` rounds half to even)."""
    return math.floor(value + 0.5)


def tail_split(tokens: np.ndarray, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split off the last ``validation_fraction`` of ``tokens``.

    Each side gets at least one token when there are two or more.
    """
    num_validation = tail_split_size(tokens.size, validation_fraction)
    return tokens[: tokens.size - num_validation], tokens[tokens.size - num_validation :]


def tail_split_size(size: int, validation_fraction: float) -> int:
    """How many of ``size`` tokens (two or more) the tail split holds out: at least one, and
    one fewer than all."""
    return min(max(1, round(size * validation_fraction)), size - 1)


def split_by_file(
    names: list[str], validation_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """Partition file names into (train, validation), keeping the input order within each.

    A name goes to validation when ``crc32(name, seed) % 1000 < validation_fraction * 1000``:
    stable across runs, machines and additions of other files. With two or more names both
    parts are non-empty: the lowest-hashed name is forced into validation, the highest into train.
    """
    assert len(names) >= 2, "by-file split needs at least two files"
    buckets = {name: zlib.crc32(name.encode(), int(seed)) % 1000 for name in names}
    threshold = validation_fraction * 1000
    validation = {name for name in names if buckets[name] < threshold}
    ranked = sorted(names, key=lambda name: (buckets[name], name))
    if not validation:
        validation = {ranked[0]}
    if len(validation) == len(names):
        validation.discard(ranked[-1])
    return [n for n in names if n not in validation], [n for n in names if n in validation]
