"""Deterministic, stateless example sampling: the data position is one integer.

An *example* is a window of ``seq_len + 1`` consecutive tokens (inputs plus next-token
targets); window ``w`` is ``tokens[w * seq_len : w * seq_len + seq_len + 1]``, so windows
tile the array and neighbours share one boundary token. Global example index ``i`` is
window ``perm_e[i % num_windows]`` of epoch ``e = i // num_windows``, where
``perm_e = np.random.default_rng([seed, e]).permutation(num_windows)``. A checkpoint
stores the number of examples consumed; a resumed run passes it back as ``position``.
"""

from __future__ import annotations

import abc

import numpy as np

from theseus.config import check_int
from theseus.data.shards import ShardedTokens

VALIDATION_SEED = 0


class IndexedExamples(abc.ABC):
    """Examples at global indices (:meth:`gather`), read as batches of a data position."""

    @abc.abstractmethod
    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Examples at global ``indices``, int32 of shape indices.shape + (seq_len + 1,)."""

    def global_batch(
        self, position: int, accumulation_steps: int, examples_per_microbatch: int
    ) -> np.ndarray:
        """The ``accumulation_steps * examples_per_microbatch`` examples from ``position``.

        Microbatch-major: element ``[a, j]`` is example
        ``position + a * examples_per_microbatch + j``.
        Returns int32 of shape (accumulation_steps, examples_per_microbatch, seq_len + 1).
        """
        return self.local_batch(position, accumulation_steps, examples_per_microbatch, slice(None))

    def local_batch(
        self,
        position: int,
        accumulation_steps: int,
        examples_per_microbatch: int,
        rows: slice | np.ndarray,
    ) -> np.ndarray:
        """``global_batch(...)[:, rows]``, reading only the windows of those rows.

        ``rows`` is a slice or 1-D array of example indices in ``[0, examples_per_microbatch)``,
        e.g. the rows this process's devices hold. Returns int32 of shape
        (accumulation_steps, len(rows), seq_len + 1).
        """
        return self.gather(
            batch_indices(position, accumulation_steps, examples_per_microbatch, rows)
        )


class Sampler(IndexedExamples):
    """Maps global example indices to token windows of one split. Immutable apart from a cache."""

    def __init__(self, tokens: np.ndarray | ShardedTokens, seq_len: int, seed: int):
        if not isinstance(tokens, np.ndarray | ShardedTokens) or tokens.ndim != 1:
            raise TypeError(f"tokens must be a 1-D numpy array, got {type(tokens).__name__}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
        check_int("seq_len", seq_len, minimum=1)
        check_int("seed", seed, minimum=0)
        num_windows = (tokens.size - 1) // seq_len
        if num_windows < 1:
            raise ValueError(
                f"a split of {tokens.size} tokens holds no window of seq_len + 1 = "
                f"{seq_len + 1} tokens; lower the sequence length or supply more data"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = num_windows
        self._cached_epoch = -1
        self._cached_permutation = np.empty(0, dtype=np.int64)

    def examples(self, start: int, count: int) -> np.ndarray:
        """Examples ``start .. start + count - 1`` as int32, shape (count, seq_len + 1)."""
        check_int("start", start, minimum=0)
        check_int("count", count, minimum=0)
        return self.gather(start + np.arange(count, dtype=np.int64))

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Windows of global example ``indices``, int32 of shape indices.shape + (seq_len + 1,)."""
        flat = indices.reshape(-1)  # (n,)
        epochs, offsets = np.divmod(flat, self.num_windows)
        windows = np.empty_like(flat)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            windows[in_epoch] = self._permutation(int(epoch))[offsets[in_epoch]]
        token_indices = windows[:, None] * self.seq_len + np.arange(
            self.seq_len + 1
        )  # (n, seq_len + 1)
        examples = np.asarray(self.tokens[token_indices], dtype=np.int32)  # (n, seq_len + 1)
        return examples.reshape(*indices.shape, self.seq_len + 1)

    def _permutation(self, epoch: int) -> np.ndarray:
        """Window order of ``epoch``; the most recent one is cached."""
        if epoch != self._cached_epoch:
            self._cached_permutation = np.random.default_rng([self.seed, epoch]).permutation(
                self.num_windows
            )
            self._cached_epoch = epoch
        return self._cached_permutation


def validation_batches(
    tokens: np.ndarray | ShardedTokens, seq_len: int, num_batches: int, examples_per_batch: int
) -> np.ndarray:
    """The fixed validation set: ``num_batches`` batches from the validation split ``tokens``.

    The batches are examples ``0 .. num_batches * examples_per_batch - 1`` of
    ``Sampler(tokens, seq_len, seed=VALIDATION_SEED)``: a shuffled spread over the whole
    split that depends only on these arguments, never on the training seed or position.
    Windows repeat (in a new shuffled order, as the next epoch) only when the split has
    fewer than ``num_batches * examples_per_batch`` windows.
    Returns int32 of shape (num_batches, examples_per_batch, seq_len + 1).
    """
    check_int("num_batches", num_batches, minimum=1)
    check_int("examples_per_batch", examples_per_batch, minimum=1)
    sampler = Sampler(tokens, seq_len, VALIDATION_SEED)
    if sampler.num_windows < examples_per_batch:
        raise ValueError(
            f"the validation split ({tokens.size} tokens) has {sampler.num_windows} windows of "
            f"seq_len + 1 = {seq_len + 1} tokens, but one validation batch needs "
            f"{examples_per_batch}; lower the validation batch size or sequence length, "
            "or raise validation_fraction"
        )
    return sampler.global_batch(0, num_batches, examples_per_batch)


def batch_indices(
    position: int, accumulation_steps: int, examples_per_microbatch: int, rows: slice | np.ndarray
) -> np.ndarray:
    """Global example indices of ``rows`` of the batch at ``position``: element ``[a, j]`` is
    ``position + a * examples_per_microbatch + rows[j]``, shape (accumulation_steps, rows)."""
    check_int("position", position, minimum=0)
    check_int("accumulation_steps", accumulation_steps, minimum=1)
    check_int("examples_per_microbatch", examples_per_microbatch, minimum=1)
    row_indices = _row_indices(rows, examples_per_microbatch)  # (rows,)
    microbatch_starts = position + examples_per_microbatch * np.arange(
        accumulation_steps, dtype=np.int64
    )
    return microbatch_starts[:, None] + row_indices[None, :]  # (accumulation, rows)


def _row_indices(rows: slice | np.ndarray, examples_per_microbatch: int) -> np.ndarray:
    """``rows`` as a 1-D int64 array of example indices within a microbatch."""
    if isinstance(rows, slice):
        return np.arange(examples_per_microbatch, dtype=np.int64)[rows]
    rows = np.asarray(rows)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise TypeError(
            f"rows must be a slice or a 1-D integer array, got {rows.dtype} of shape {rows.shape}"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= examples_per_microbatch):
        raise ValueError(
            f"rows range over [{rows.min()}, {rows.max()}], outside [0, {examples_per_microbatch}) "
            "of examples_per_microbatch"
        )
    return rows.astype(np.int64)
