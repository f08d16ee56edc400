"""GPT's cached decoding: the layers of :func:`theseus.model.gpt.block` reading and writing a
fixed-length KV cache, for ``theseus generate`` (the interface is in :mod:`theseus.model.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from theseus.model.decode import ROWS, CacheArray
from theseus.model.gpt import GPTConfig
from theseus.model.layers import dense, layer_norm, linear
from theseus.model.lora import scaled


@dataclass(frozen=True)
class GPTDecoder:
    """GPT with a cache of keys and values: ``k`` and ``v`` of shape (n_layer, rows, cache_len,
    n_attn), named (``n_layer``, rows, ``block_size``, ``n_attn``): rows over ``batch``, heads
    over ``shard`` (as the q/k/v projections are split in training), in the compute dtype."""

    config: GPTConfig
    compute_dtype: jnp.dtype
    lora_scale: float = 0.0  # alpha / rank of the run's LoRA adapters (0: none)

    @property
    def context_len(self) -> int:
        return self.config.block_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def cache(self, num_rows: int, cache_len: int) -> dict[str, CacheArray]:
        c = self.config
        shape = (c.n_layer, num_rows, cache_len, c.n_attn)
        names = ("n_layer", ROWS, "block_size", "n_attn")
        return {name: CacheArray(shape, self.compute_dtype, names) for name in ("k", "v")}

    def __call__(
        self, params: Any, cache: dict[str, jax.Array], tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        _, num_new = tokens.shape
        query_positions = positions[:, None] + jnp.arange(num_new)  # (rows, n)
        wte = params["wte"]  # (vocab, n_embd)
        positions_table = params["wpe"][query_positions].astype(jnp.float32)  # (rows, n, n_embd)
        x = wte[tokens].astype(jnp.float32) + positions_table

        def layer_step(x, inputs):
            layer, k_cache, v_cache = inputs  # caches (rows, cache_len, n_attn)
            layer = scaled(layer, self.lora_scale) if self.lora_scale else layer
            h = layer_norm(x, **layer["ln1"], dtype=self.compute_dtype)  # (rows, n, n_embd)
            q = linear(h, **layer["attn_q"])  # (rows, n, n_attn)
            k_cache = _write(k_cache, linear(h, **layer["attn_k"]), positions)
            v_cache = _write(v_cache, linear(h, **layer["attn_v"]), positions)
            attended = cached_attention(q, k_cache, v_cache, query_positions, self.config.n_head)
            x = x + linear(attended, **layer["attn_out"]).astype(jnp.float32)  # (rows, n, n_embd)
            h = layer_norm(x, **layer["ln2"], dtype=self.compute_dtype)
            h = jax.nn.gelu(linear(h, **layer["mlp_fc"]), approximate=True)  # (rows, n, n_mlp)
            x = x + linear(h, **layer["mlp_proj"]).astype(jnp.float32)  # (rows, n, n_embd)
            return x, (k_cache, v_cache)

        x, (k, v) = jax.lax.scan(layer_step, x, (params["blocks"], cache["k"], cache["v"]))
        h = layer_norm(x, **params["ln_f"], dtype=self.compute_dtype)  # (rows, n, n_embd)
        logits = dense(h, wte, jnp.float32, transposed=True)  # (rows, n, vocab)
        return logits, {"k": k, "v": v}


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """``cache`` (rows, cache_len, n_attn) with ``new`` (rows, n, n_attn) written at rows'
    ``positions`` (rows,) onwards."""
    new = new.astype(cache.dtype)
    return jax.vmap(lambda c, u, p: jax.lax.dynamic_update_slice(c, u, (p, 0)))(
        cache, new, positions
    )


def cached_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, query_positions: jax.Array, n_head: int
) -> jax.Array:
    """Multi-head attention of queries ``q`` (rows, n, n_attn) at ``query_positions`` (rows, n)
    over cache ``k``, ``v`` (rows, cache_len, n_attn): each query reads cache positions up to its
    own. Float32 scores and softmax, as in :func:`theseus.model.layers.causal_attention`."""
    rows, num_new, n_attn = q.shape
    cache_len = k.shape[1]
    head_dim = n_attn // n_head
    q = q.reshape(rows, num_new, n_head, head_dim)
    k, v = (t.reshape(rows, cache_len, n_head, head_dim) for t in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(head_dim))  # (rows, n_head, n, cache_len)
    visible = jnp.arange(cache_len) <= query_positions[:, None, :, None]  # (rows, 1, n, cache_len)
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # (rows, n_head, n, cache_len)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(rows, num_new, n_attn).astype(q.dtype)  # (rows, n, n_attn)
