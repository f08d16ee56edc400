"""The parameters every decoder family builds from: a float32 parameter with logical names, a
stacked projection (with optional bias and LoRA adapters) and a norm (RMS or layer norm), with
the two functions that apply them to activations.

A projection stores its weight either as ``kernel`` ``(n_layer, d_in, d_out)`` (layout ``io``,
GPT's) or as ``weight`` ``(n_layer, d_out, d_in)`` (layout ``oi``, Hugging Face's), so checkpoints
of either kind load without transposing; :func:`project` reads the layout from the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from theseus.model.layers import dense, layer_norm, rms_norm
from theseus.model.lora import adapter_out

Names = tuple[str | None, ...]
Layout = Literal["io", "oi"]


def param(
    rngs: nnx.Rngs, shape: tuple[int, ...], names: Names | None, init: nnx.Initializer
) -> nnx.Param:
    """A float32 parameter with its logical ``names`` in ``out_sharding`` (none when None).

    ``eager_sharding=False``: the names are logical, not mesh axes, so flax must never apply them.
    """
    if names is not None:
        init = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), eager_sharding=False)


class StackedProjection(nnx.Module):
    """``n_layer`` projections from ``d_in`` to ``d_out`` (logical ``names`` (in, out)) in
    ``layout``, normal(``std``) initialised, with a zero ``bias`` (n_layer, d_out) when asked.

    The bias is named after the output dimension unless that is ``n_embd`` (replicated), so TP
    splits it with the weight. LoRA may adapt the weight (:mod:`theseus.model.lora`).
    """

    def __init__(
        self,
        n_layer: int,
        d_in: int,
        d_out: int,
        names: tuple[str, str],
        layout: Layout,
        *,
        bias: bool,
        std: float,
        rngs: nnx.Rngs,
    ):
        in_name, out_name = names
        self.lora_layout = layout
        self.lora_weight = "kernel" if layout == "io" else "weight"
        shape, weight_names = (d_in, d_out), names
        if layout == "oi":
            shape, weight_names = (d_out, d_in), (out_name, in_name)
        weight = param(
            rngs, (n_layer, *shape), ("n_layer", *weight_names), nnx.initializers.normal(std)
        )
        setattr(self, self.lora_weight, weight)
        if bias:
            bias_names = ("n_layer", None if out_name == "n_embd" else out_name)
            self.bias = param(rngs, (n_layer, d_out), bias_names, nnx.initializers.zeros)


class Norm(nnx.Module):
    """A norm's parameters of ``shape`` (``(dim,)``, or ``(n_layer, dim)`` stacked) with logical
    ``names``: RMSNorm's ``weight``, or LayerNorm's ``scale`` and ``bias``."""

    def __init__(
        self,
        shape: tuple[int, ...],
        names: Names | None,
        *,
        kind: Literal["rms", "layer"],
        rngs: nnx.Rngs,
    ):
        if kind == "rms":
            self.weight = param(rngs, shape, names, nnx.initializers.ones)
        else:
            self.scale = param(rngs, shape, names, nnx.initializers.ones)
            self.bias = param(rngs, shape, names, nnx.initializers.zeros)


class Stack(nnx.Module):
    """A family's layers: the stacked modules under their names, in the order given."""

    def __init__(self, modules: Mapping[str, nnx.Module]):
        for name, module in modules.items():
            setattr(self, name, module)


def project(x: jax.Array, proj: dict) -> jax.Array:
    """One layer's projection of ``x`` (.., d_in) to (.., d_out) in ``x.dtype``: the bias and
    the LoRA adapters' share (when the projection has them) are added in float32 before the one
    rounding."""
    transposed = "weight" in proj
    weight = proj["weight"] if transposed else proj["kernel"]
    if "bias" not in proj and "lora_a" not in proj:
        return dense(x, weight, transposed=transposed)
    out = dense(x, weight, jnp.float32, transposed=transposed)  # (.., d_out)
    if "lora_a" in proj:
        out = out + adapter_out(x, proj, transposed=transposed)
    return (out + proj["bias"] if "bias" in proj else out).astype(x.dtype)


def norm(x: jax.Array, params: dict, eps: float, dtype: DTypeLike) -> jax.Array:
    """RMSNorm (``params`` has a ``weight``) or LayerNorm (``scale`` and ``bias``) of ``x`` over
    its last axis, float32 statistics, cast to ``dtype``."""
    if "weight" in params:
        return rms_norm(x, params["weight"], eps, dtype)
    return layer_norm(x, params["scale"], params["bias"], dtype, eps)
