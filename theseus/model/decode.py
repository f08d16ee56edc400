"""The decode interface: what ``theseus generate`` needs from a model to sample with a KV cache.

A trainer that can generate defines ``decoder()`` returning an object with this interface (GPT's
is :class:`theseus.model.decoder.CachedDecoder`):

- ``context_len``: the most positions the model reads (GPT: ``block_size``); ``vocab_size``: the
  width of its logits.
- ``cache(num_rows, cache_len)``: the cache as a dict of :class:`CacheArray` (shape, dtype and
  logical names per array). Name the prompt dimension :data:`ROWS` (it is split over ``batch``);
  other names resolve with the model's TP rules (GPT's keys and values are ``n_attn`` wide, so
  attention heads split over ``shard`` as in training). Generation creates the arrays as zeros.
- ``__call__(params, cache, tokens, positions)``: ``tokens`` (rows, n) int32 sit at positions
  ``positions[r] + 0 .. n - 1`` of row ``r``; returns float32 logits (rows, n, vocab) and the
  cache with those positions written. Attention must read only cache positions ``<=`` each
  query's own, so entries past a row's position (padding, older garbage) never matter.

``params`` is the model's parameter dict (``nnx.to_pure_dict`` of its ``nnx.Param`` state), in the
compute layout. Prefill calls the decoder once with the prompts right-padded to one length; each
decode step calls it with one token per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
from jax.typing import DTypeLike

ROWS = "rows"  # logical name of the prompt dimension of cache arrays: split over `batch`


@dataclass(frozen=True)
class CacheArray:
    """One cache array: global shape, dtype and a logical name per dimension."""

    shape: tuple[int, ...]
    dtype: DTypeLike
    names: tuple[str | None, ...]


class Decoder(Protocol):
    """A model's cached decoding (see the module docstring)."""

    @property
    def context_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def cache(self, num_rows: int, cache_len: int) -> dict[str, CacheArray]: ...

    def __call__(
        self, params: Any, cache: dict[str, jax.Array], tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...
