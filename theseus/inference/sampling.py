"""Choosing the next token: greedy, temperature, top-k and top-p, with a key per row and position.

The key of row ``r`` (prompt ``p``, sample ``s``: ``r = p * num_samples + s``) at sequence
position ``t`` is ``fold_in(fold_in(key(seed), r), t)``. It depends on neither the batch layout
nor the device count, so every layout draws the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from theseus.config import is_int


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature=0`` is greedy (argmax); ``top_k`` keeps the k
    most likely tokens, ``top_p`` the smallest set whose probability reaches p (both optional).
    The values are inputs of the compiled step, so changing them compiles nothing."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(
                f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)"
            )
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1, or None for no limit")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1], or None for no limit")

    def arrays(self) -> dict[str, np.generic]:
        """The settings as step inputs: top_k 0 and top_p 1 mean no limit."""
        return {
            "temperature": np.float32(self.temperature),
            "top_k": np.int32(self.top_k or 0),
            "top_p": np.float32(1.0 if self.top_p is None else self.top_p),
        }


def sample_keys(seed: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """One key per row: ``fold_in(fold_in(key(seed), row), position)``; rows, positions (rows,)."""
    base = jax.random.key(seed)
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(base, r), t))(
        rows, positions
    )


@struct.dataclass
class Chosen:
    """The ids chosen for each row (rows,) int32, and each one's log-probability (rows,)
    float32 under the distribution it was drawn from: the logits over the temperature, with
    what top-k and top-p cut off removed (0 for a greedy choice). RL keeps these as the
    sampler's log-probabilities."""

    ids: jax.Array
    logps: jax.Array


def next_tokens(
    logits: jax.Array, keys: jax.Array, settings: dict[str, jax.Array], num_valid: int
) -> Chosen:
    """The :class:`Chosen` ids from float32 ``logits`` (rows, vocab), one key per row, with
    ``Sampling.arrays()`` as ``settings``; ids from ``num_valid`` on are never chosen (a
    vocabulary padded beyond the tokenizer's)."""
    vocab = logits.shape[-1]
    if num_valid < vocab:
        logits = jnp.where(jnp.arange(vocab) < num_valid, logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # (rows,)
    temperature, top_k, top_p = settings["temperature"], settings["top_k"], settings["top_p"]
    logits = logits / jnp.where(temperature > 0, temperature, 1.0)  # (rows, vocab)
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # (rows, vocab) descending
    kth = ordered[:, jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab) - 1]  # (rows,)
    logits = jnp.where(logits < kth[:, None], -jnp.inf, logits)
    ordered = jnp.where(ordered < kth[:, None], -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    kept = jnp.where(before < top_p, ordered, jnp.inf)  # the first is always kept
    cutoff = jnp.where(top_p < 1, jnp.min(kept, axis=-1), -jnp.inf)  # (rows,)
    logits = jnp.where(logits < cutoff[:, None], -jnp.inf, logits)
    sampled = jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
    ids = jnp.where(temperature > 0, sampled, greedy)  # (rows,)
    drawn = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), sampled[:, None], axis=-1)
    return Chosen(ids, jnp.where(temperature > 0, drawn[:, 0], 0.0))
