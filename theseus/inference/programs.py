"""Compiled programs of one mesh, one per batch shape: what generation and scoring run.

A :class:`Program` is a function and the abstract arguments it is compiled for (each a
``jax.ShapeDtypeStruct`` carrying its sharding); :class:`ProgramCache` jits it on the mesh with
those shardings, lowers and compiles it ahead of time, once per shape key. A batch of another
shape then costs one compilation, a batch of a shape seen before none.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding


@dataclass(frozen=True)
class Program:
    """``fn`` for ``inputs`` (a tuple of pytrees of sharded ``ShapeDtypeStruct``), with its
    results laid out by ``outputs`` and the arguments of ``donate`` given up to them."""

    fn: Callable[..., Any]
    inputs: tuple[Any, ...]
    outputs: Any
    donate: tuple[int, ...] = ()


def compile_program(mesh: Mesh, program: Program) -> jax.stages.Compiled:
    """``program`` jitted with explicit in/out shardings on ``mesh``, lowered and compiled."""
    in_shardings = jax.tree.map(lambda arg: arg.sharding, program.inputs)
    with jax.set_mesh(mesh):
        jitted = jax.jit(
            program.fn,
            in_shardings=in_shardings,
            out_shardings=program.outputs,
            donate_argnums=program.donate,
        )
        return jitted.lower(*program.inputs).compile()


class ProgramCache:
    """Compiled programs by shape key: ``cache(key, build)`` compiles the programs ``build()``
    gives the first time ``key`` is asked for and returns the same executables after."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._compiled: dict[Hashable, tuple[jax.stages.Compiled, ...]] = {}

    def __len__(self) -> int:
        """Shape keys compiled so far."""
        return len(self._compiled)

    def __call__(
        self, key: Hashable, build: Callable[[], tuple[Program, ...]]
    ) -> tuple[jax.stages.Compiled, ...]:
        if key not in self._compiled:
            self._compiled[key] = tuple(compile_program(self.mesh, p) for p in build())
        return self._compiled[key]


def global_array(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``array`` (the same in every process) as a global array laid out by ``sharding``: each
    process places the part its own devices hold."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
