"""The decode interface: what ``theseus generate`` needs from a model to sample with a KV cache.

A trainer that can generate defines ``decoder()`` returning an object with this interface (GPT's
is :class:`theseus.model.cached_decoder.CachedDecoder`):

- ``context_len``: the most positions the model reads (GPT: ``block_size``); ``vocab_size``: the
  width of its logits.
- ``cache(num_rows, cache_len)``: the cache for positions ``0 .. cache_len - 1`` as a pytree
  (nested dicts) of :class:`CacheArray` (shape, dtype, logical names and fill value per array).
  Name the prompt dimension :data:`ROWS` (it is split over ``batch``); other names resolve with
  the model's TP rules (GPT's keys and values are ``n_attn`` wide, so attention heads split over
  ``shard`` as in training). Generation creates each array filled with its ``fill``.
- ``__call__(params, cache, tokens, positions, lengths=None)``: ``tokens`` (rows, n) int32 sit at
  positions ``positions[r] + 0 .. n - 1`` of row ``r``, of which the first ``lengths[r]`` are
  real and the rest padding (None: all real); returns the float32 logits (rows, vocab) of each
  row's next token (after its last real one; a long prompt's logits at every position would be
  prompt × vocab floats) and the cache with the real positions written (padding is computed but
  not kept). Attention must read only cache positions ``<=`` each query's own, so entries past
  a row's position (older garbage) never matter.

``params`` is the model's ``nnx.Param`` state (the
:class:`~theseus.model.cached_decoder.CachedDecoder` merges it with the model's graphdef and
reads typed weights), in the compute layout. Prefill calls the decoder once with the prompts
right-padded to one length; each decode step calls it with one token per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
from jax.typing import DTypeLike

ROWS = "rows"  # logical name of the prompt dimension of cache arrays: split over `batch`


@dataclass(frozen=True)
class CacheArray:
    """One cache array: global shape, dtype, a logical name per dimension and the value it
    starts filled with."""

    shape: tuple[int, ...]
    dtype: DTypeLike
    names: tuple[str | None, ...]
    fill: int | float = 0


class Decoder(Protocol):
    """A model's cached decoding (see the module docstring)."""

    @property
    def context_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def cache(self, num_rows: int, cache_len: int) -> Any: ...

    def __call__(
        self,
        params: Any,
        cache: Any,
        tokens: jax.Array,
        positions: jax.Array,
        lengths: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]: ...
