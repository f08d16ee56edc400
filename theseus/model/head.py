"""The output head: the final norm and the projection to the vocabulary, as logits (decoding,
inference) or as the log-probabilities of target tokens (every loss in training and
evaluation, and task scoring with each target's greedy flag), which are computed a chunk of
positions at a time.

A loss over the whole sequence at once holds float32 logits (examples, seq, vocab), their
softmax and their gradient: 47 GiB for Llama 3.1 8B at 32,768 tokens, more than the layers'
activations. :func:`chunked_scores` runs the head over ``chunk`` positions per step of a
``jax.lax.scan`` whose body is rematerialised (``jax.checkpoint``), so the forward and the
backward pass each hold one chunk's logits (examples, chunk, vocab) at a time; the backward
recomputes them from the normed stream, which is all the scan keeps (one more head matmul per
token). A sequence of one chunk is computed directly: its logits are the forward's last op and
the backward's first, so recomputing them would save nothing. The numbers are the whole
sequence's (each position's log-softmax reads its own logits only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from theseus.model.attention import soft_cap
from theseus.model.layers import dense

T = TypeVar("T")

#: What one chunk's float32 logits may take per device by default (:func:`default_chunk`).
CHUNK_LOGITS_BYTES = 256 * 2**20


def default_chunk(vocab_size: int, examples: int) -> int:
    """Positions per chunk when ``training.loss_chunk`` is unset: the largest power of two
    whose float32 logits for ``examples`` rows fit in :data:`CHUNK_LOGITS_BYTES` (at least 1):
    512 for Llama 3.1 8B's 128,256 tokens and one example; a short sequence is one chunk."""
    fits = max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size * examples))
    return 1 << (fits.bit_length() - 1)


def head_logits(
    h: jax.Array, table: jax.Array, softcap: float | None
) -> jax.Array:  # (batch, seq, vocab)
    """Float32 logits of the normed stream ``h`` (batch, seq, n_embd) through ``table``
    (vocab, n_embd), soft-capped at ``softcap`` (None: uncapped)."""
    return soft_cap(dense(h, table, jnp.float32, transposed=True), softcap)


def logits(
    final_norm: Any, table: jax.Array, x: jax.Array, compute_dtype: Any, softcap: float | None
) -> jax.Array:
    """Logits (batch, seq, vocab) float32 of the stream ``x``: ``final_norm``, then the head."""
    return head_logits(final_norm(x, compute_dtype), table, softcap)


def chunked_scores(
    score: Callable[[jax.Array, jax.Array], T],
    final_norm: Any,
    table: jax.Array,
    x: jax.Array,
    targets: jax.Array,
    compute_dtype: Any,
    softcap: float | None,
    chunk: int,
) -> T:
    """``score(logits, targets)`` of the stream ``x`` (batch, seq, n_embd) against int
    ``targets`` (batch, seq), ``chunk`` positions at a time (see the module docstring):
    ``score`` reads one chunk's float32 logits (batch, c, vocab) and returns a pytree of
    (batch, c) arrays (:func:`target_logps_of`, :func:`scores_of_logits`,
    :func:`sampled_at`), so no logits (batch, seq, vocab) exist."""

    def chunk_scores(h_c: jax.Array, t_c: jax.Array) -> T:
        """(batch, c, n_embd) and (batch, c) in, (batch, c) arrays out."""
        return score(head_logits(h_c, table, softcap), t_c)

    return _chunked(chunk_scores, final_norm(x, compute_dtype), targets, chunk)


def target_logps_of(z: jax.Array, targets: jax.Array) -> jax.Array:
    """Each target's float32 log-probability (batch, seq) under logits ``z`` (batch, seq,
    vocab): what every loss reads."""
    return -optax.softmax_cross_entropy_with_integer_labels(z, targets)


@struct.dataclass
class ScoredTargets:
    """Per target (batch, seq): its float32 log-probability, and whether it is its position's
    argmax (what greedy decoding would produce)."""

    logps: jax.Array
    greedy: jax.Array


def scores_of_logits(z: jax.Array, targets: jax.Array) -> ScoredTargets:
    """The :class:`ScoredTargets` of float32 logits ``z`` (batch, seq, vocab) against int
    ``targets`` (batch, seq): what task scoring reads."""
    return ScoredTargets(target_logps_of(z, targets), jnp.argmax(z, axis=-1) == targets)


@struct.dataclass
class SampledLogps:
    """Per target (batch, seq) float32: its log-probability under the logits over a sampling
    temperature, and the entropy of that distribution."""

    logps: jax.Array
    entropies: jax.Array


def sampled_at(temperature: float) -> Callable[[jax.Array, jax.Array], SampledLogps]:
    """The scorer of the logits over ``temperature`` (the distribution RL samples from and
    trains, as TRL's ``GRPOTrainer`` computes it): each target's log-probability and each
    position's entropy."""

    def score(z: jax.Array, targets: jax.Array) -> SampledLogps:
        log_p = jax.nn.log_softmax(z / temperature, axis=-1)  # (batch, c, vocab)
        chosen = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]  # (batch, c)
        return SampledLogps(chosen, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1))

    return score


def _chunked(
    score: Callable[[jax.Array, jax.Array], T], h: jax.Array, targets: jax.Array, chunk: int
) -> T:
    """``score`` of the normed stream ``h`` (batch, seq, n_embd) and ``targets`` (batch, seq),
    whose results are pytrees of (batch, c) arrays, ``chunk`` positions at a time: the full
    chunks in a scan, the positions left over (fewer than ``chunk``) in one more call of the
    same rematerialised body."""
    batch, seq, width = h.shape
    if seq <= chunk:  # the last op of the forward, the first of the backward: nothing to save
        return score(h, targets)
    remat = jax.checkpoint(score)
    full = seq // chunk * chunk
    hs = h[:, :full].reshape(batch, -1, chunk, width).swapaxes(0, 1)  # (n, batch, c, width)
    ts = targets[:, :full].reshape(batch, -1, chunk).swapaxes(0, 1)  # (n, batch, c)
    _, out = jax.lax.scan(lambda _, xs: (None, remat(*xs)), None, (hs, ts))
    scores = jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(batch, full), out)  # (batch, full)
    if full == seq:
        return scores
    rest = remat(h[:, full:], targets[:, full:])
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), scores, rest)
