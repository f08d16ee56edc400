"""Choosing the next token: greedy, temperature, top-k and top-p, with a key per row and position.

The key of row ``r`` (prompt ``p``, sample ``s``: ``r = p * num_samples + s``) at sequence
position ``t`` is ``fold_in(fold_in(key(seed), r), t)``. It depends on neither the batch layout
nor the device count, so every layout draws the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature=0`` is greedy (argmax); ``top_k`` keeps the k
    most likely tokens, ``top_p`` the smallest set whose probability reaches p (both optional).
    ``num_valid`` masks ids at and above it (a vocabulary padded beyond the tokenizer's)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_valid: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(
                f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)"
            )
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1, or None for no limit")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1], or None for no limit")


def sample_keys(seed: int, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """One key per row: ``fold_in(fold_in(key(seed), row), position)``; rows, positions (rows,)."""
    base = jax.random.key(seed)
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(base, r), t))(
        rows, positions
    )


def next_tokens(logits: jax.Array, keys: jax.Array, sampling: Sampling) -> jax.Array:
    """The chosen ids (rows,) int32 from float32 ``logits`` (rows, vocab), one key per row."""
    vocab = logits.shape[-1]
    if sampling.num_valid is not None and sampling.num_valid < vocab:
        logits = jnp.where(jnp.arange(vocab) < sampling.num_valid, logits, -jnp.inf)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature  # (rows, vocab)
    if sampling.top_k is not None and sampling.top_k < vocab:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]  # (rows, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # (rows, vocab) descending
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)  # the first is always kept
        cutoff = jnp.min(kept, axis=-1, keepdims=True)  # (rows, 1): smallest kept logit
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
