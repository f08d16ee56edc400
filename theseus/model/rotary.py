"""Rotary position embeddings for every family that uses them: the inverse frequencies (plain, or
Llama 3.1's frequency-dependent scaling) as transformers computes them, the rotation of heads in
Hugging Face's layout, and the ``config.json`` rotary keys in both directions.

A family's model section names its rotary settings ``rope_theta``, ``rope_type`` (``default``,
``linear`` or ``llama3``), for ``linear`` and ``llama3`` ``rope_factor``, and for ``llama3``
``rope_low_freq_factor``, ``rope_high_freq_factor`` and ``rope_original_max_position_embeddings``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_SCALING_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
_CASTS = (float, float, float, int)


def inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """Inverse frequencies ``(head_dim / 2,)`` float32 of the rotary settings ``rope``."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(rope["rope_theta"]), exponents)).astype(np.float32)
    if rope["rope_type"] == "default":
        return inv
    if rope["rope_type"] == "linear":
        return (inv / np.float32(rope["rope_factor"])).astype(np.float32)
    factor, low, high = (
        rope["rope_factor"],
        rope["rope_low_freq_factor"],
        rope["rope_high_freq_factor"],
    )
    old_len = rope["rope_original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary(
    positions: jax.Array, inv_freq: tuple[float, ...] | jax.Array
) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``(..., head_dim)`` float32 of integer ``positions`` (...) and the inverse
    frequencies ``inv_freq`` (head_dim / 2,) (a tuple, or a layer's row of layer-indexed data)."""
    inv = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv  # (..., head_dim / 2)
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # (..., head_dim)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate heads ``x`` (batch, seq, heads, head_dim) by ``cos``/``sin`` (batch, seq, head_dim)
    in float32, Hugging Face's layout (the first half of a head pairs with the second)."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)  # (batch, seq, heads, head_dim)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def rope_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The rotary settings of a ``config.json``, transformers 5.x (``rope_parameters``) or 4.x
    (top-level ``rope_theta`` and ``rope_scaling``); other scalings are refused."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5.x
        return rope_settings(params, params["rope_theta"], where)
    return rope_settings(hf.get("rope_scaling") or {}, hf.get("rope_theta", 10000.0), where)


def rope_settings(scaling: dict[str, Any], theta: float, where: str) -> dict[str, Any]:
    """The rotary settings of a rotary base ``theta`` and a Hugging Face scaling dict (its
    ``rope_type``, or 4.x's ``type``); scalings theseus does not reproduce are refused."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(
            f"{where}: rotary scaling rope_type={rope_type!r} is not supported; theseus "
            "reproduces 'default', 'linear' and 'llama3' (Llama 3.1)"
        )
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "linear":
        out["rope_factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        out |= {f"rope_{k}": f(scaling[k]) for k, f in zip(_SCALING_KEYS, _CASTS, strict=True)}
    return out


def rope_to_hf(model: dict[str, Any]) -> dict[str, Any]:
    """transformers 5.x ``rope_parameters`` of a model section."""
    rope = {"rope_type": model["rope_type"], "rope_theta": model["rope_theta"]}
    if model["rope_type"] == "linear":
        rope["factor"] = model["rope_factor"]
    if model["rope_type"] == "llama3":
        rope |= {k: model[f"rope_{k}"] for k in _SCALING_KEYS}
    return rope
