"""The losses a step adds up: next-token cross-entropy as a sum over trained tokens and their
count (:class:`TokenLoss`), and what a segmented row says about its targets and positions.

A segmented row (packed examples, or a pretraining window split at its end-of-text tokens) is
int32 ``(ROW_FIELDS, seq_len + 1)``: tokens, loss mask (1 where the token trains as a target) and
segment ids (1, 2, ... for the examples in order, 0 for padding). Token ``i + 1`` is the target of
input ``i`` and trains when its mask is 1 and it is in the segment of input ``i`` (never padding,
never the first token of the next example). Positions restart at 0 at each segment's first token.

Document masking (``data.document_masking=true``) makes the same rows of a pretraining stream:
a document ends with its end-of-text token, which stays in its segment and trains as the target
of the document's last token; the next document starts a new segment at position 0, as a packed
example does, so the first token of a document is no target (it would be predicted across the
boundary). Every other token trains.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import struct

from theseus.data.packing import MASK, SEGMENTS, TOKENS
from theseus.model.experts import RouterSums, aux_loss, z_loss
from theseus.sharding.axis import Axis


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of logits (examples, seq, vocab) against targets (examples, seq)."""
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@struct.dataclass
class RoutingLoss:
    """A microbatch's routing losses as the step adds them up (each a replica's share, which
    sum over the replicas of the microbatch): ``aux`` (the load-balancing loss), ``z`` (the
    router z-loss), ``weighted`` (each times its coefficient and the microbatch's trained
    tokens: what the objective adds to the token loss's total), ``load`` (experts,), the
    top-k choices of each expert, and the choices ``dropped`` beyond capacity."""

    aux: jax.Array
    z: jax.Array
    weighted: jax.Array
    load: jax.Array
    dropped: jax.Array


@struct.dataclass
class TokenLoss:
    """A loss as the step adds it up: the sum of per-item losses over the items that train
    (float32) and their number (int32): tokens for next-token losses, pairs for preference
    losses. Sums over microbatches and replicas, divided once, give the mean over the items of
    the whole global batch, whatever the layout. ``sums`` are further per-item metrics summed
    the same way (reported as means, :meth:`means`); ``tokens`` the trained tokens when the
    items are not tokens (None: ``count``). A model with experts adds its ``routing`` loss in
    training (None: none)."""

    total: jax.Array
    count: jax.Array
    sums: dict[str, jax.Array] = struct.field(default_factory=dict)
    tokens: jax.Array | None = None
    routing: RoutingLoss | None = None

    def mean(self) -> jax.Array:
        return self.total / self.count

    def means(self) -> dict[str, jax.Array]:
        """Each of ``sums`` over ``count``."""
        return {name: value / self.count for name, value in self.sums.items()}

    def trained_tokens(self) -> jax.Array:
        return self.count if self.tokens is None else self.tokens

    def plus(self, other: TokenLoss) -> TokenLoss:
        """This and ``other`` added, ``other``'s leaves summed over any leading dimension (the
        replicas of a microbatch); both have the same structure (``routing`` None in both, or a
        :class:`RoutingLoss` in both)."""
        return jax.tree.map(lambda a, b: a + b.reshape(-1, *a.shape).sum(0), self, other)

    def objective(self) -> jax.Array:
        """What training differentiates: the total, plus the weighted routing loss. Divided by
        the step's ``count`` it is the mean loss plus the coefficient times the ``count``-weighted
        mean of the microbatches' routing losses."""
        return self.total if self.routing is None else self.total + self.routing.weighted


def zero_token_loss() -> TokenLoss:
    """The sum of no next-token losses."""
    return TokenLoss(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))


def across_replicas(x: jax.Array) -> jax.Array:
    """``x`` summed over the replicas of a microbatch where the step runs each replica on its
    own (a ``shard_map`` manual over ``batch``); elsewhere ``x`` is already the whole
    microbatch's."""
    if Axis.BATCH in jax.sharding.get_abstract_mesh().manual_axes:
        return jax.lax.psum(x, Axis.BATCH)
    return x


def with_routing(loss: TokenLoss, sums: RouterSums | None) -> TokenLoss:
    """``loss`` with the load-balancing loss and the router z-loss of the routing statistics
    ``sums`` (None: no experts, or not training; ``loss`` as it is): the choices and token rows
    of the whole microbatch (every replica's), so replicas, tensor parallelism and FSDP leave
    them as one device computes them. Weighted by the microbatch's ``count`` (tokens, or pairs
    for a preference loss), as the objective is."""
    if sums is None:
        return loss
    counts, rows, tokens = (across_replicas(x) for x in (sums.counts, sums.rows, loss.count))
    aux, z = aux_loss(sums, counts, rows), z_loss(sums, rows)
    weighted = (sums.coef * aux + sums.z_coef * z) * tokens.astype(jnp.float32)
    routing = RoutingLoss(aux=aux, z=z, weighted=weighted, load=sums.counts, dropped=sums.dropped)
    return dataclasses.replace(loss, routing=routing)


def masked_token_loss(logps: jax.Array, weights: jax.Array) -> TokenLoss:
    """Cross-entropy of the targets' log-probabilities ``logps`` (examples, seq), summed where
    ``weights`` (examples, seq; 0 or 1) is 1."""
    per_token = -logps  # (examples, seq)
    return TokenLoss(jnp.sum(per_token * weights), jnp.sum(weights, dtype=jnp.int32))


def row_fields(rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tokens, loss mask and segment ids (each (examples, seq_len + 1)) of segmented rows
    (examples, ROW_FIELDS, seq_len + 1)."""
    return rows[:, TOKENS], rows[:, MASK], rows[:, SEGMENTS]


def target_weights(mask: jax.Array, segments: jax.Array) -> jax.Array:
    """1 where input ``i``'s target (token ``i + 1``) trains: its mask is 1 and it is in input
    ``i``'s segment, which is not padding. (examples, seq_len + 1) in, (examples, seq_len) out."""
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] != 0)
    return jnp.where(same, mask[:, 1:], 0).astype(jnp.float32)


def segment_positions(segments: jax.Array) -> jax.Array:
    """Positions that restart at 0 where the segment id changes: (examples, seq) in and out."""
    index = jnp.arange(segments.shape[1])  # (seq,)
    starts = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1
    )  # (examples, seq)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # each token's segment start
    return index - first
