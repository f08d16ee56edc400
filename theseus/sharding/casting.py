"""Which inputs of a function it only ever reads through a cast to a lower dtype.

Gathering such an input in the compute dtype instead of its float32 storage dtype gives the
function exactly the values it would have read anyway (rounding commutes with gathering: each
element is rounded once, on the device that holds it), at half the bytes. An input read any other
way (a LayerNorm scale used in float32, an embedding table indexed in float32) is not castable:
rounding it first would change the numbers.

The answer comes from the function's jaxpr, traced once on abstract values: an input is castable
when every use of it is a ``convert_element_type`` to the compute dtype, looking through calls
whose one sub-jaxpr takes the caller's operands in order (``jit``, ``custom_vjp``/``custom_jvp``
functions such as :func:`theseus.model.layers.dense`, ``checkpoint``). Anything else, and an input
returned as an output, counts as a use at full precision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core


def _sub_jaxpr(eqn: Any) -> core.Jaxpr | None:
    """The one sub-jaxpr of a call-like equation whose inputs are the equation's operands in
    order, else None."""
    subs = [p for p in eqn.params.values() if isinstance(p, core.Jaxpr | core.ClosedJaxpr)]
    if len(subs) != 1:
        return None
    sub = subs[0].jaxpr if isinstance(subs[0], core.ClosedJaxpr) else subs[0]
    return sub if len(sub.invars) == len(eqn.invars) else None


def _only_cast(jaxpr: core.Jaxpr, var: Any, dtype: np.dtype) -> bool:
    """True when every use of ``var`` in ``jaxpr`` is a cast to ``dtype``."""
    if any(out is var for out in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        positions = [i for i, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        name = eqn.primitive.name
        if name == "convert_element_type" and np.dtype(eqn.params["new_dtype"]) == dtype:
            continue
        sub = _sub_jaxpr(eqn)
        if sub is None or not all(_only_cast(sub, sub.invars[i], dtype) for i in positions):
            return False
    return True


def cast_only_inputs(
    fn: Callable[..., Any], args: Sequence[Any], dtype: np.dtype, which: Sequence[bool]
) -> list[bool]:
    """Per leaf of ``args`` (flattened as ``jax.tree.leaves(args)``): True when ``which`` marks
    it and ``fn(*args)`` reads it only through a cast to ``dtype``. Traced abstractly; the
    arguments may be arrays, tracers or ``ShapeDtypeStruct`` s."""
    dtype = np.dtype(dtype)
    leaves, treedef = jax.tree.flatten(args)
    abstract = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    closed = jax.make_jaxpr(lambda *flat: fn(*jax.tree.unflatten(treedef, flat)))(*abstract)
    invars = closed.jaxpr.invars
    return [
        bool(wanted) and _only_cast(closed.jaxpr, var, dtype)
        for var, wanted in zip(invars, which, strict=True)
    ]
