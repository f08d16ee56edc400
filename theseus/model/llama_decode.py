"""Llama-family cached decoding: the layers of :func:`theseus.model.llama.block` reading and
writing a fixed-length KV cache, for ``theseus generate`` (interface in :mod:`theseus.model.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from theseus.model.decode import ROWS, CacheArray
from theseus.model.gpt_decode import _write
from theseus.model.llama import LlamaConfig, head, inverse_frequencies, mlp, project, qkv, rms_norm
from theseus.model.lora import scaled


@dataclass(frozen=True)
class LlamaDecoder:
    """A Llama-family model with a cache of keys and values: ``k`` and ``v`` of shape (n_layer,
    rows, cache_len, n_kv), named (``n_layer``, rows, None, ``n_kv``): rows over ``batch``,
    key/value heads over ``shard`` (as the k/v projections are split in training), rotated keys
    in the compute dtype."""

    config: LlamaConfig
    compute_dtype: jnp.dtype
    lora_scale: float = 0.0  # alpha / rank of the run's LoRA adapters (0: none)

    @property
    def context_len(self) -> int:
        return self.config.context_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def cache(self, num_rows: int, cache_len: int) -> dict[str, CacheArray]:
        c = self.config
        shape = (c.num_layers, num_rows, cache_len, c.n_kv)
        names = ("n_layer", ROWS, None, "n_kv")
        return {name: CacheArray(shape, self.compute_dtype, names) for name in ("k", "v")}

    def __call__(
        self, params: Any, cache: dict[str, jax.Array], tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        c, dtype = self.config, self.compute_dtype
        rows, num_new = tokens.shape
        head_dim, eps = c.dim_per_head, c.rms_norm_eps
        query_positions = positions[:, None] + jnp.arange(num_new)  # (rows, n)
        inv_freq = np.asarray(inverse_frequencies(c))
        freqs = query_positions.astype(jnp.float32)[..., None] * inv_freq  # (rows, n, hd / 2)
        angles = jnp.concatenate([freqs, freqs], axis=-1)  # (rows, n, head_dim)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        x = params["embed_tokens"][tokens].astype(jnp.float32)  # (rows, n, n_embd)

        def layer_step(x, inputs):
            layer, k_cache, v_cache = inputs  # caches (rows, cache_len, n_kv)
            layer = scaled(layer, self.lora_scale) if self.lora_scale else layer
            h = rms_norm(x, layer["input_layernorm"]["weight"], eps, dtype)  # (rows, n, n_embd)
            q, k, v = qkv(layer, h, cos, sin, head_dim=head_dim, eps=eps)
            k_cache = _write(k_cache, k.reshape(rows, num_new, -1), positions)
            v_cache = _write(v_cache, v.reshape(rows, num_new, -1), positions)
            cache_len = k_cache.shape[1]
            keys, values = (
                t.reshape(rows, cache_len, -1, head_dim).astype(q.dtype) for t in (k_cache, v_cache)
            )
            visible = jnp.arange(cache_len) <= query_positions[:, None, :, None]  # (rows,1,n,len)
            attended = jax.nn.dot_product_attention(q, keys, values, mask=visible)
            out = project(attended.reshape(rows, num_new, -1), layer["o_proj"])  # (rows, n, e)
            x = mlp(layer, x + out.astype(jnp.float32), eps=eps, dtype=dtype)
            return x, (k_cache, v_cache)

        x, (k, v) = jax.lax.scan(layer_step, x, (params["layers"], cache["k"], cache["v"]))
        return head(params, x, eps, dtype), {"k": k, "v": v}  # (rows, n, vocab)
