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

import math

import jax
import jax.numpy as jnp
from flax import struct

VALIDATION_SEED = 0


@struct.dataclass
class Keys:
    """The random keys one loss evaluation receives (typed keys, ``jax.random.key``).

    Attributes:
        examples: ``(examples,)``, one key per example of the microbatch (in ``BaseTrainer.loss``; a step
            holds them for its whole batch): per-example randomness such as dropout masks drawn
            from it is the same under every layout.
        step: one key for the whole step, shared by all its microbatches and replicas.
    """

    examples: jax.Array
    step: jax.Array


def example_keys(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Keys of ``shape``, a (microbatch-major) batch's leading dims: the element at row-major
    index ``i`` is ``fold_in(key, i)``, the key of the example at global index ``i``. Any
    reshape of the batch that keeps row-major order (e.g. into replicas) keeps each key with its
    example."""
    index = jnp.arange(math.prod(shape))  # (examples of the whole batch,)
    return jax.vmap(jax.random.fold_in, (None, 0))(key, index).reshape(shape)


def step_keys(run_key: jax.Array, step: jax.Array, shape: tuple[int, ...]) -> Keys:
    """The keys of training step ``step`` (steps done before it): ``fold_in(run_key, step)`` and
    its example keys of ``shape``. ``run_key`` is the raw ``uint32[2]`` key of a TrainState."""
    key = jax.random.fold_in(jax.random.wrap_key_data(run_key), step)
    return Keys(example_keys(key, shape), key)


def validation_keys(shape: tuple[int, ...]) -> Keys:
    """The keys of the held-out set, example keys of ``shape`` and a fixed step key. Validation
    is deterministic (``train=False``); a model that draws randomness there anyway gets the
    same numbers every time and under every layout."""
    key = jax.random.key(VALIDATION_SEED)
    return Keys(example_keys(key, shape), key)
