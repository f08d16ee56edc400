"""Preference pairs in rows: both sides of a pair in one row, chosen then rejected.

A preference corpus is a masked corpus whose examples come in pairs: example ``2k`` is pair
``k``'s chosen sequence and ``2k + 1`` its rejected one, each mask 1 on its completion tokens.
A pair row is int32 ``(PAIR_FIELDS, seq_len + 1)``: the fields of a packed row
(:mod:`theseus.data.packing`: tokens, mask, segment ids) and ``REFERENCE``, which holds at each
example's first token the float32 bits of its reference log-probability (0 elsewhere, and
everywhere when the run has no precomputed reference). Segments ``2j - 1`` and ``2j`` of a row
are its ``j``-th pair's chosen and rejected sides, so a pair never crosses rows.

``packed`` rows hold as many whole pairs as fit (first-fit decreasing over pairs, as
:func:`~theseus.data.packing.pack` packs examples); ``padded`` rows hold one pair each. Either
way the rows of a split are fixed for a run and permuted per epoch, as packed rows are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from theseus.data.packing import (
    MASK,
    SEGMENTS,
    TOKENS,
    MaskedExamples,
    Overlong,
    Packing,
    RowSampler,
    pack,
    shuffled_order,
)

REFERENCE = 3
PAIR_FIELDS = 4
PairLayout = Literal["packed", "padded"]


def check_pairs(examples: MaskedExamples, where: str) -> None:
    """A preference split has an even number of examples (chosen, rejected, ...)."""
    if examples.lengths.size % 2:
        raise ValueError(
            f"{where} has {examples.lengths.size} examples, an odd number: a preference corpus "
            "holds pairs (chosen, then rejected), so its examples come two by two; tokenize "
            "preference records (prompt, chosen, rejected) with `theseus tokenize`"
        )


def pair_packing(
    examples: MaskedExamples,
    row_tokens: int,
    seed: int,
    overlong: Overlong,
    layout: PairLayout,
    where: str,
) -> Packing:
    """Rows of whole pairs: ``members`` are pair indices, ``kept`` their two sides' tokens.
    ``overlong=truncate`` is refused: a cut pair would score a completion it does not hold."""
    check_pairs(examples, where)
    if overlong == "truncate":
        raise ValueError(
            f"{where}: data.overlong=truncate would cut preference pairs, scoring completions "
            "they do not hold; set data.overlong=error (the default) or data.overlong=drop "
            "(leave out the pairs longer than a row)"
        )
    totals = examples.lengths.reshape(-1, 2).sum(1)  # (pairs,): both sides' tokens
    drop = "set data.overlong=drop (leave out the pairs longer than a row)"
    order, num_long = shuffled_order(totals, row_tokens, seed, overlong, where, drop)
    if layout == "packed":
        return pack(totals, row_tokens, seed, overlong, where)
    return Packing(
        np.arange(order.size + 1, dtype=np.int64),
        order,
        totals[order],
        row_tokens,
        int(totals.size),
        truncated=0,
        dropped=num_long if overlong == "drop" else 0,
    )


def build_pair_rows(
    examples: MaskedExamples,
    packing: Packing,
    rows: np.ndarray,
    reference: np.ndarray | None,
) -> np.ndarray:
    """Rows ``rows`` (n,) of a :func:`pair_packing` as int32 (n, PAIR_FIELDS, row_tokens);
    ``reference`` (examples,) float32 or None."""
    out = np.zeros((rows.size, PAIR_FIELDS, packing.row_tokens), np.int32)
    starts, lengths = examples.starts, examples.lengths
    for place, row in enumerate(rows):
        offset, segment = 0, 1
        for member in range(packing.row_starts[row], packing.row_starts[row + 1]):
            pair = int(packing.members[member])
            for example in (2 * pair, 2 * pair + 1):
                begin, size = int(starts[example]), int(lengths[example])
                span = slice(offset, offset + size)
                out[place, TOKENS, span] = examples.tokens[begin : begin + size]
                out[place, MASK, span] = examples.mask[begin : begin + size]
                out[place, SEGMENTS, span] = segment
                if reference is not None:
                    out[place, REFERENCE, offset] = reference[example : example + 1].view(np.int32)[
                        0
                    ]
                offset, segment = offset + size, segment + 1
    return out


def pair_examples(row: int, packing: Packing) -> np.ndarray:
    """The example index of each segment of ``packing``'s row ``row``: (2 × pairs,) int64, in
    segment order (segment ``s`` is entry ``s - 1``)."""
    pairs = packing.members[packing.row_starts[row] : packing.row_starts[row + 1]]
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)


class PairSampler(RowSampler):
    """The pair rows of one split (permuted per epoch as packed rows are); ``reference``
    (examples,) float32 fills the ``REFERENCE`` field."""

    def __init__(
        self,
        examples: MaskedExamples,
        seq_len: int,
        seed: int,
        overlong: Overlong,
        layout: PairLayout,
        where: str,
        reference: np.ndarray | None = None,
    ):
        self.examples = examples
        self.packing = pair_packing(examples, seq_len + 1, seed, overlong, layout, where)
        self.seed = seed
        self.num_windows = self.packing.num_rows
        self.reference = reference

    def rows(self, rows: np.ndarray) -> np.ndarray:
        return build_pair_rows(self.examples, self.packing, rows, self.reference)


@dataclass(frozen=True)
class PairRows:
    """What makes a mixture's masked sources pair rows: the layout, and the reference
    log-probabilities of each source's splits ((source name, split) -> (examples,) float32;
    empty before they are computed, and for a reference-free loss)."""

    layout: PairLayout
    reference: dict[tuple[str, int], np.ndarray]


def examples_of_pairs(
    pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> MaskedExamples:
    """A split of ``(chosen_ids, chosen_mask, rejected_ids, rejected_mask)`` pairs, in memory."""
    sides = [side for pair in pairs for side in ((pair[0], pair[1]), (pair[2], pair[3]))]
    lengths = np.asarray([len(ids) for ids, _ in sides], np.int64)
    tokens = np.concatenate([np.asarray(ids) for ids, _ in sides]).astype(np.int32)
    mask = np.concatenate([np.asarray(m) for _, m in sides]).astype(np.uint8)
    return MaskedExamples(tokens, mask, lengths)
