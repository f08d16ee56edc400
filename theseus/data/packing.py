"""Packing a masked corpus's examples into rows with segment ids.

A row is int32 ``(ROW_FIELDS, seq_len + 1)``: tokens, loss mask (1 where the token trains) and
segment ids (1, 2, ... for its examples in order; 0 for padding, whose mask is 0 and which never
trains). A row holds up to ``seq_len + 1`` tokens, the span of a plain window: an example of
``L`` tokens gives ``L - 1`` next-token targets, so an example of exactly ``seq_len + 1`` tokens
fills a row.

The algorithm (:func:`pack`), seeded and stated: the split's examples are shuffled by
``np.random.default_rng([seed, PACKING_SALT])``; an example longer than a row is handled as
``data.overlong`` says (``truncate``: its first ``seq_len + 1`` tokens; ``drop``; ``error``);
then each run of ``PACK_BUFFER`` consecutive examples of that order is packed by first-fit
decreasing: longest first (ties in shuffled order), each into the first row of the run with room,
else a new row. Rows keep the order in which the run opened them. The rows are fixed for a run:
:class:`PackedSampler` permutes them per epoch as :class:`~theseus.data.sampler.Sampler`
permutes windows, so the data position is one integer and a resumed run reads the same batches.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from theseus.config import check_int
from theseus.data.sampler import IndexedExamples, Sampler
from theseus.data.shards import ShardedTokens

TOKENS, MASK, SEGMENTS = range(3)
ROW_FIELDS = 3
PACK_BUFFER = 1024
PACKING_SALT = 0x5041  # keeps the packing order apart from other uses of the seed
Overlong = Literal["truncate", "drop", "error"]


@dataclass(frozen=True)
class MaskedExamples:
    """One split of a masked corpus: its tokens and loss mask (aligned, 1-D, possibly
    memory-mapped) and its examples' lengths in order (their running sum is where each
    begins)."""

    tokens: np.ndarray | ShardedTokens
    mask: np.ndarray | ShardedTokens
    lengths: np.ndarray  # (examples,) int64

    @cached_property
    def starts(self) -> np.ndarray:
        """Where each example begins: (examples,) int64."""
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)


@dataclass(frozen=True)
class Packing:
    """Rows of examples: row ``r`` holds examples ``members[row_starts[r]:row_starts[r + 1]]``
    (indices into the split's examples), example ``members[i]`` cut to ``kept[i]`` tokens."""

    row_starts: np.ndarray  # (rows + 1,) int64
    members: np.ndarray  # (packed examples,) int64
    kept: np.ndarray  # (packed examples,) int64
    row_tokens: int  # seq_len + 1
    num_examples: int
    truncated: int
    dropped: int

    @property
    def num_rows(self) -> int:
        return self.row_starts.size - 1

    @property
    def efficiency(self) -> float:
        """The fraction of row tokens that are not padding."""
        return float(self.kept.sum()) / (self.num_rows * self.row_tokens)

    def facts(self) -> dict:
        """The run.json entry of a packed split."""
        return {
            "examples": self.num_examples,
            "rows": self.num_rows,
            "efficiency": round(self.efficiency, 6),
            "truncated": self.truncated,
            "dropped": self.dropped,
        }


def pack(
    lengths: np.ndarray, row_tokens: int, seed: int, overlong: Overlong, where: str
) -> Packing:
    """Pack examples of ``lengths`` (examples,) into rows of ``row_tokens`` as the module says."""
    lengths = np.asarray(lengths, np.int64)
    order, num_long = shuffled_order(lengths, row_tokens, seed, overlong, where)
    kept_of = np.minimum(lengths, row_tokens)
    row_starts, members = [0], []
    for begin in range(0, order.size, PACK_BUFFER):
        run = order[begin : begin + PACK_BUFFER]
        for row in first_fit_decreasing(kept_of[run], row_tokens):
            members.extend(run[row])
            row_starts.append(len(members))
    member_ids = np.asarray(members, np.int64)
    if not member_ids.size:
        raise ValueError(
            f"{where}: no example is left to train after data.overlong=drop ({num_long} of "
            f"{lengths.size} are longer than {row_tokens} tokens); raise training.seq_len"
        )
    truncated = num_long if overlong == "truncate" else 0
    dropped = num_long if overlong == "drop" else 0
    return Packing(
        np.asarray(row_starts, np.int64),
        member_ids,
        kept_of[member_ids],
        row_tokens,
        int(lengths.size),
        truncated,
        dropped,
    )


TRUNCATE_OR_DROP = (
    "set data.overlong=truncate (keep each one's first {row} tokens) or data.overlong=drop "
    "(leave them out)"
)


def shuffled_order(
    lengths: np.ndarray,
    row_tokens: int,
    seed: int,
    overlong: Overlong,
    where: str,
    remedy: str = TRUNCATE_OR_DROP,
) -> tuple[np.ndarray, int]:
    """The examples of ``lengths`` (examples,) in their seeded shuffled order, those longer than
    a row left out under ``overlong=drop`` (refused under ``error``, the message ending with
    ``remedy``); and how many are longer."""
    check_int("row_tokens", row_tokens, minimum=2)
    order = np.random.default_rng([seed, PACKING_SALT]).permutation(lengths.size)  # (examples,)
    long = lengths[order] > row_tokens
    num_long = int(long.sum())
    if num_long and overlong == "error":
        raise ValueError(
            f"{where}: {num_long} of {lengths.size} examples are longer than a row of "
            f"training.seq_len + 1 = {row_tokens} tokens (the longest has {lengths.max()}); "
            f"raise training.seq_len, or {remedy.format(row=row_tokens)}"
        )
    return (order[~long] if overlong == "drop" else order), num_long


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Rows of indices into ``lengths`` (each at most ``capacity``): longest first (ties in
    given order), each into the first row with room, else a new row; rows in opening order,
    each row's indices in the order they were placed."""
    rows: list[list[int]] = []
    room = np.empty(lengths.size, np.int64)  # (rows,), the first len(rows) in use
    for index in np.argsort(-lengths, kind="stable"):
        fits = room[: len(rows)] >= lengths[index]
        row = int(fits.argmax()) if fits.any() else len(rows)
        if row == len(rows):
            rows.append([])
            room[row] = capacity
        rows[row].append(int(index))
        room[row] -= lengths[index]
    return [np.asarray(row, np.int64) for row in rows]


def build_rows(examples: MaskedExamples, packing: Packing, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (n,) of ``packing`` as int32 (n, ROW_FIELDS, row_tokens)."""
    out = np.zeros((rows.size, ROW_FIELDS, packing.row_tokens), np.int32)
    starts = examples.starts
    for place, row in enumerate(rows):
        offset = 0
        for segment, member in enumerate(
            range(packing.row_starts[row], packing.row_starts[row + 1]), start=1
        ):
            example, kept = packing.members[member], int(packing.kept[member])
            begin = int(starts[example])
            span = slice(offset, offset + kept)
            out[place, TOKENS, span] = examples.tokens[begin : begin + kept]
            out[place, MASK, span] = examples.mask[begin : begin + kept]
            out[place, SEGMENTS, span] = segment
            offset += kept
    return out


class RowSampler(IndexedExamples):
    """Maps global example indices to the fixed rows of one split: index ``i`` is row
    ``perm_e[i % num_windows]`` of epoch ``e = i // num_windows``, ``perm_e`` drawn as
    :class:`~theseus.data.sampler.Sampler` draws its windows' order. A subclass builds rows."""

    seed: int
    num_windows: int
    _epoch: int = -1
    _permutation: np.ndarray = np.empty(0, np.int64)

    @abc.abstractmethod
    def rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (n,) in the split's row order, int32 (n, fields, seq_len + 1)."""

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Rows of global ``indices``, int32 of shape indices.shape + (fields, seq_len + 1)."""
        flat = np.asarray(indices, np.int64).reshape(-1)  # (n,)
        epochs, offsets = np.divmod(flat, self.num_windows)
        rows = np.empty_like(flat)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            rows[chosen] = self._order(int(epoch))[offsets[chosen]]
        built = self.rows(rows)
        return built.reshape(*np.shape(indices), *built.shape[1:])

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._permutation, self._epoch = rng.permutation(self.num_windows), epoch
        return self._permutation


class PackedSampler(RowSampler):
    """The packed rows of one split of a masked corpus (:func:`pack`)."""

    def __init__(
        self, examples: MaskedExamples, seq_len: int, seed: int, overlong: Overlong, where: str
    ):
        check_int("seq_len", seq_len, minimum=1)
        self.examples = examples
        self.packing = pack(examples.lengths, seq_len + 1, seed, overlong, where)
        self.seed = seed
        self.num_windows = self.packing.num_rows

    def rows(self, rows: np.ndarray) -> np.ndarray:
        return build_rows(self.examples, self.packing, rows)


class DocumentRows(IndexedExamples):
    """A window sampler's windows as segmented rows (:func:`document_rows`)."""

    def __init__(self, windows: Sampler, eos_id: int | None):
        self.windows = windows
        self.eos_id = eos_id
        self.num_windows = windows.num_windows

    def gather(self, indices: np.ndarray) -> np.ndarray:
        return document_rows(self.windows.gather(indices), self.eos_id)


def document_rows(windows: np.ndarray, eos_id: int | None) -> np.ndarray:
    """Plain windows (..., seq_len + 1) as segmented rows (..., ROW_FIELDS, seq_len + 1), every
    token trained: one segment per window when ``eos_id`` is None, else a new segment after each
    end-of-text token (which ends its document; positions restart after it)."""
    segments = np.ones_like(windows)
    if eos_id is not None:
        ends = (windows == eos_id).astype(np.int32)  # (..., seq_len + 1)
        segments += np.cumsum(ends, axis=-1) - ends  # ends before each token
    return np.stack([windows, np.ones_like(windows), segments], axis=-2).astype(np.int32)
