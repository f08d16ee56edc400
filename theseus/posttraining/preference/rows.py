"""Pair rows (:mod:`theseus.data.pairs`) as the preference loss reads them: per-example
completion log-probabilities, by segment sums of the targets' log-probabilities, which the model
computes a chunk of positions at a time
(:meth:`~theseus.training.family.FamilyTrainer.target_logps`): no array grows with the
vocabulary beyond one chunk's logits.

Segment ``s`` of a row sums the log-probabilities of its trained targets (token ``i + 1`` of
input ``i`` where both are in ``s`` and the mask is 1: :func:`~theseus.training.losses.
target_weights`), so a packed row gives each of its examples the sum that example alone would.
Segments ``2j - 1`` and ``2j`` are pair ``j``'s chosen and rejected sides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from theseus.data.packing import SEGMENTS
from theseus.data.pairs import REFERENCE
from theseus.posttraining.preference.objective import PairLogps
from theseus.training.losses import row_fields, target_weights


def segment_sums(values: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
    """Sums of ``values`` (examples, seq) by segment id ``segments`` (examples, seq):
    (examples, num_segments), column ``s`` for segment ``s`` (0: padding)."""
    rows = jnp.arange(values.shape[0])[:, None]  # (examples, 1)
    zeros = jnp.zeros((values.shape[0], num_segments), values.dtype)
    return zeros.at[rows, segments].add(values)


@struct.dataclass
class SegmentLogps:
    """Per row and segment (each (examples, segments) float32): the summed log-probabilities of
    the completion's targets and their number."""

    sums: jax.Array
    tokens: jax.Array


def completion_logps(token_logps: jax.Array, rows: jax.Array) -> SegmentLogps:
    """Each segment's summed completion log-probability over pair rows (examples, fields,
    seq_len + 1), from each target's log-probability ``token_logps`` (examples, seq_len)."""
    _, mask, segments = row_fields(rows)
    weights = target_weights(mask, segments)  # (examples, seq_len)
    num = rows.shape[-1] + 1  # every example holds at least one token
    inputs = segments[:, :-1]
    return SegmentLogps(
        segment_sums(token_logps * weights, inputs, num), segment_sums(weights, inputs, num)
    )


def stored_reference(rows: jax.Array) -> jax.Array:
    """The reference log-probabilities the rows carry (``REFERENCE``: float32 bits at each
    example's first token), per row and segment: (examples, seq_len + 2)."""
    values = jax.lax.bitcast_convert_type(rows[:, REFERENCE], jnp.float32)  # (examples, seq + 1)
    return segment_sums(values, rows[:, SEGMENTS], rows.shape[-1] + 1)


@struct.dataclass
class RowPairs:
    """The pairs of a batch of rows, flattened to (examples × pairs per row,): the policy's
    log-probabilities and whether each slot holds a pair (1.0) or none (0.0)."""

    policy: PairLogps
    valid: jax.Array


def pair_slots(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Chosen and rejected entries of per-segment ``values`` (examples, segments), each
    (examples × pairs,): segments 1, 3, ... and 2, 4, ...."""
    pairs = (values.shape[1] - 1) // 2
    chosen = values[:, 1 : 1 + 2 * pairs : 2]  # (examples, pairs)
    rejected = values[:, 2 : 2 + 2 * pairs : 2]
    return chosen.reshape(-1), rejected.reshape(-1)


def row_pairs(logps: SegmentLogps, rows: jax.Array) -> RowPairs:
    """The pairs of ``rows`` and their policy log-probabilities ``logps``; a slot without a
    pair gets log-probabilities -1 over one token, harmless to every loss (masked out)."""
    segments = rows[:, SEGMENTS]
    present = segment_sums(jnp.ones_like(segments, jnp.float32), segments, logps.sums.shape[1])
    _, valid = pair_slots(jnp.minimum(present, 1.0))  # a pair is there when its rejected is
    chosen, rejected = pair_slots(logps.sums)
    chosen_tokens, rejected_tokens = pair_slots(logps.tokens)
    empty = valid == 0
    return RowPairs(
        PairLogps(
            jnp.where(empty, -1.0, chosen),
            jnp.where(empty, -1.0, rejected),
            jnp.where(empty, 1.0, chosen_tokens),
            jnp.where(empty, 1.0, rejected_tokens),
        ),
        valid,
    )


def reference_pairs(sums: jax.Array, pairs: RowPairs) -> PairLogps:
    """Per-segment reference log-probabilities ``sums`` (examples, segments) as the pairs of
    ``pairs`` (the same slots; empty ones -1, as there)."""
    chosen, rejected = pair_slots(sums)
    empty = pairs.valid == 0
    policy = pairs.policy
    return PairLogps(
        jnp.where(empty, -1.0, chosen),
        jnp.where(empty, -1.0, rejected),
        policy.chosen_tokens,
        policy.rejected_tokens,
    )
