"""The typed weights every decoder family builds from: a float32 parameter with logical names, a
stacked :class:`Projection` (with optional bias and LoRA adapters) and the norms
(:class:`RMSNorm`, :class:`LayerNorm`), each a frozen dataclass registered as a pytree and read by
attribute. What a piece computes follows from its type and its static fields, never from which
keys a dict holds.

A model holds these values with ``nnx.Param`` leaves (``nnx.data``), so its state paths are the
field names (``layers/q_proj/weight``); :func:`arrays` gives the same values with the arrays
themselves, which the forward pass reads. A projection stores its weight as ``kernel``
``(n_layer, d_in, d_out)`` (layout ``io``, GPT's) or as ``weight`` ``(n_layer, d_out, d_in)``
(layout ``oi``, Hugging Face's), so checkpoints of either kind load without transposing; its
adapters are ``lora_a`` and ``lora_b`` beside it (:mod:`theseus.model.lora`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, TypeVar, dataclass_transform

import jax
import jax.numpy as jnp
from flax import nnx
from jax.tree_util import GetAttrKey
from jax.typing import DTypeLike

from theseus.model.layers import dense, layer_norm, rms_norm
from theseus.sharding.layout import path_str

Names = tuple[str | None, ...]
Layout = Literal["io", "oi"]
T = TypeVar("T")

#: A projection's weight is stored under this name in each layout.
WEIGHT_NAME: dict[str, str] = {"io": "kernel", "oi": "weight"}


def static(default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is part of a pytree's structure, not a leaf."""
    return dataclasses.field(default=default, metadata={"static": True})


# Type checkers read a class decorated by ``weights`` as the keyword-only frozen dataclass it is.
@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(static,))
def weights(cls: type[T]) -> type[T]:
    """``cls`` as a frozen, keyword-only dataclass registered as a pytree (fields marked
    :func:`static` are structure): the weights of a piece, read by attribute."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True, kw_only=True)(cls))


def arrays(tree: T) -> T:
    """``tree`` with each ``nnx.Variable`` replaced by its array (the same array object, so
    :func:`theseus.scan_layers` recognises the parameters it gathers)."""
    return jax.tree.map(
        lambda v: v.get_value(), tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def param(
    rngs: nnx.Rngs, shape: tuple[int, ...], names: Names | None, init: nnx.Initializer
) -> nnx.Param:
    """A float32 parameter with its logical ``names`` in ``out_sharding`` (none when None).

    ``eager_sharding=False``: the names are logical, not mesh axes, so flax must never apply them.
    """
    if names is not None:
        init = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), eager_sharding=False)


@weights
class Lora:
    """A projection's LoRA adapters in its weight's layout (see :mod:`theseus.model.lora`):
    ``ΔW = a @ b`` (``io``) or ``b @ a`` (``oi``), scaled by ``scale`` (alpha / rank)."""

    a: Any
    b: Any
    scale: float = static()

    def out(self, x: jax.Array, *, transposed: bool) -> jax.Array:
        """The adapters' share of a projection of ``x`` (.., d_in): ``scale · x ΔW`` (or ΔWᵀ
        when ``transposed``), (.., d_out) float32, through the rank-wide product."""
        low = dense(x, self.a, transposed=transposed)  # (.., rank)
        return dense(low, self.b * self.scale, jnp.float32, transposed=transposed)  # (.., d_out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Projection:
    """A (stacked) projection from ``d_in`` to ``d_out``: ``weight`` in ``layout``, an optional
    ``bias`` (.., d_out) and optional ``lora`` adapters. As a pytree its leaves are named as
    checkpoints store them: ``kernel`` or ``weight`` (by layout), ``bias``, ``lora_a``,
    ``lora_b``."""

    weight: Any
    bias: Any = None
    lora: Lora | None = None
    layout: Layout = "oi"

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` (.., d_in) projected to (.., d_out) in ``x.dtype``: the bias and the adapters'
        share (when there are any) are added in float32 before the one rounding."""
        transposed = self.layout == "oi"
        if self.bias is None and self.lora is None:
            return dense(x, self.weight, transposed=transposed)
        out = dense(x, self.weight, jnp.float32, transposed=transposed)  # (.., d_out)
        if self.lora is not None:
            out = out + self.lora.out(x, transposed=transposed)
        return (out if self.bias is None else out + self.bias).astype(x.dtype)


def _keyed_children(p: Projection) -> tuple[tuple, tuple]:
    """The leaves under their checkpoint names (absent ones None) and the structure: the
    layout and the adapters' scale (None: no adapters)."""
    a, b = (None, None) if p.lora is None else (p.lora.a, p.lora.b)
    children = ((WEIGHT_NAME[p.layout], p.weight), ("bias", p.bias), ("lora_a", a), ("lora_b", b))
    scale = None if p.lora is None else p.lora.scale
    return tuple((GetAttrKey(name), child) for name, child in children), (p.layout, scale)


def _children(p: Projection) -> tuple[tuple, tuple]:
    keyed, structure = _keyed_children(p)
    return tuple(child for _, child in keyed), structure


def _projection_of(structure: tuple, children: Any) -> Projection:
    (layout, scale), (weight, bias, a, b) = structure, children
    lora = None if scale is None else Lora(a=a, b=b, scale=scale)
    return Projection(weight=weight, bias=bias, lora=lora, layout=layout)


jax.tree_util.register_pytree_with_keys(Projection, _keyed_children, _projection_of, _children)


def stacked_projection(
    n_layer: int,
    d_in: int,
    d_out: int,
    names: tuple[str, str],
    layout: Layout,
    *,
    bias: bool,
    std: float,
    rngs: nnx.Rngs,
) -> Projection:
    """``n_layer`` projections from ``d_in`` to ``d_out`` (logical ``names`` (in, out)) in
    ``layout``, normal(``std``) initialised, with a zero ``bias`` (n_layer, d_out) when asked.

    The bias is named after the output dimension unless that is ``n_embd`` (replicated), so TP
    splits it with the weight."""
    out_name = names[1]
    shape, weight_names = ((d_in, d_out), names) if layout == "io" else ((d_out, d_in), names[::-1])
    normal = nnx.initializers.normal(std)
    weight = param(rngs, (n_layer, *shape), ("n_layer", *weight_names), normal)
    bias_names = ("n_layer", None if out_name == "n_embd" else out_name)
    zeros = nnx.initializers.zeros
    bias_param = param(rngs, (n_layer, d_out), bias_names, zeros) if bias else None
    return Projection(weight=weight, bias=bias_param, layout=layout)


@weights
class RMSNorm:
    """RMSNorm's ``weight`` with its ``eps``; the scale is ``offset + weight`` (Gemma's norm
    stores ``weight`` as the scale minus 1: ``offset`` 1)."""

    weight: Any
    eps: float = static()
    offset: float = static(0.0)

    def __call__(self, x: jax.Array, dtype: DTypeLike) -> jax.Array:
        """``x`` normed over its last axis, float32 statistics, cast to ``dtype``."""
        scale = self.weight if self.offset == 0.0 else self.offset + self.weight  # float32
        return rms_norm(x, scale, self.eps, dtype)

    @staticmethod
    def create(
        shape: tuple[int, ...], names: Names | None, eps: float, *, rngs: nnx.Rngs, offset=0.0
    ) -> RMSNorm:
        """A norm of ``shape`` (``(dim,)``, or ``(n_layer, dim)`` stacked) whose scale starts
        at 1."""
        init = nnx.initializers.constant(1.0 - offset)
        return RMSNorm(weight=param(rngs, shape, names, init), eps=eps, offset=offset)


@weights
class LayerNorm:
    """LayerNorm's ``scale`` and ``bias`` with its ``eps``."""

    scale: Any
    bias: Any
    eps: float = static()

    def __call__(self, x: jax.Array, dtype: DTypeLike) -> jax.Array:
        """``x`` normed over its last axis, float32 statistics, cast to ``dtype``."""
        return layer_norm(x, self.scale, self.bias, dtype, self.eps)

    @staticmethod
    def create(shape: tuple[int, ...], names: Names | None, eps: float, *, rngs) -> LayerNorm:
        """A norm of ``shape`` with unit scale and zero bias."""
        scale = param(rngs, shape, names, nnx.initializers.ones)
        return LayerNorm(
            scale=scale, bias=param(rngs, shape, names, nnx.initializers.zeros), eps=eps
        )


Norm = RMSNorm | LayerNorm


def projections(model: nnx.Module) -> list[tuple[tuple[str, ...], Projection]]:
    """Every :class:`Projection` of ``model`` with its path (attribute and field names), in the
    model's order."""
    found = nnx.iter_graph(model)
    return [(tuple(map(str, path)), node) for path, node in found if isinstance(node, Projection)]


def replace_projections(
    model: nnx.Module, new: Callable[[tuple[str, ...], Projection], Projection]
) -> None:
    """Put ``new(path, projection)`` in place of each projection of ``model``: typed weights
    are frozen, so each attribute that holds projections is rebuilt around the new ones."""

    def swap(attribute: str, keys: tuple, node: Any) -> Any:
        if not isinstance(node, Projection):
            return node
        return new((attribute, *(path_str([key]) for key in keys)), node)  # fields, run keys

    def stop(x: Any) -> bool:
        return isinstance(x, Projection | nnx.Variable)

    for attribute in sorted({path[0] for path, _ in projections(model)}):
        tree = getattr(model, attribute)
        rebuilt = jax.tree_util.tree_map_with_path(
            lambda keys, node, a=attribute: swap(a, keys, node), tree, is_leaf=stop
        )
        setattr(model, attribute, nnx.data(rebuilt))
