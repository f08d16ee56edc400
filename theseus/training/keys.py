"""Randomness tied to the data, never to the layout.

Every example of a step gets its own key, ``fold_in(fold_in(run_key, step), index)``, where
``run_key`` comes from ``training.seed``, ``step`` counts the steps done before this one and
``index`` is the example's place in the step's global batch: element ``[a, j]`` of the batch
(accumulation, examples) has index ``a * examples + j``, which is the same example under every
policy, accumulation count and process count (see :meth:`Sampler.global_batch`). Randomness that
is not per example uses the step key ``fold_in(run_key, step)`` itself. Validation uses keys of its
own, derived the same way from a fixed key with the held-out set's global example index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

VALIDATION_SEED = 0


@struct.dataclass
class Keys:
    """The random keys one loss evaluation receives (typed keys, ``jax.random.key``).

    Attributes:
        examples: ``(examples,)``, one key per example of the microbatch: per-example randomness
            (dropout masks) drawn from it is the same under every layout.
        step: one key for the whole step, shared by all its microbatches and replicas.
    """

    examples: jax.Array
    step: jax.Array


def step_key(run_key: jax.Array, step: jax.Array) -> jax.Array:
    """The key of training step ``step`` (steps done before it) of the run keyed ``run_key``.

    ``run_key`` is the raw ``uint32[2]`` key a :class:`TrainState` stores (checkpointed).
    """
    return jax.random.fold_in(jax.random.wrap_key_data(run_key), step)


def example_keys(key: jax.Array, num_microbatches: int, examples: int) -> jax.Array:
    """Keys ``(num_microbatches, examples)``: element ``[a, j]`` is ``fold_in(key, a * examples
    + j)``, the key of the example at that global index of a (microbatch-major) batch."""
    index = jnp.arange(num_microbatches * examples).reshape(num_microbatches, examples)
    return jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)), (None, 0))(key, index)


def validation_keys(num_batches: int, examples: int) -> tuple[jax.Array, jax.Array]:
    """The fixed step key of validation and its example keys ``(num_batches, examples)``.

    Validation is deterministic (``train=False``); a model that draws randomness there anyway gets
    the same numbers every time and under every layout.
    """
    key = jax.random.key(VALIDATION_SEED)
    return key, example_keys(key, num_batches, examples)
