"""What a restore checks, as text a user can act on: the saved tree against the target (paths,
shapes, dtypes), and a library error in one line."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from theseus.sharding.layout import path_str


def _flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {
        path_str(path): (tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def compatibility_problems(saved: Any, target: Any) -> list[str]:
    saved_leaves = _flat_shapes(saved)
    target_leaves = _flat_shapes(target)
    problems = []
    for path, (shape, dtype) in target_leaves.items():
        if path not in saved_leaves:
            problems.append(f"{path}: in the target {shape} {dtype}, not in the checkpoint")
            continue
        saved_shape, saved_dtype = saved_leaves[path]
        if saved_shape != shape or saved_dtype != dtype:
            problems.append(
                f"{path}: checkpoint has {saved_shape} {saved_dtype}, target {shape} {dtype}"
            )
    problems += [
        f"{path}: in the checkpoint {shape} {dtype}, not in the target"
        for path, (shape, dtype) in saved_leaves.items()
        if path not in target_leaves
    ]
    return problems


def _first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n", 1)[0].split(" See full TensorStore details", 1)[0]
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}"


def one_line(error: BaseException) -> str:
    """The gist of a library error: its first line and its root cause's, without TensorStore's
    spec dump."""
    root, seen = error, {id(error)}
    while (cause := root.__cause__ or root.__context__) is not None and id(cause) not in seen:
        root = cause
        seen.add(id(root))
    if root is error:
        return _first_line(error)
    return f"{_first_line(error)} (caused by {_first_line(root)})"
