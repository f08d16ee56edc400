"""Reward functions of online RL, loaded from a spec and called as TRL's ``GRPOTrainer`` (1.16)
calls them in ``_calculate_rewards``.

A reward function takes keyword arguments: ``prompts``, ``completions`` (texts, or for
conversational prompts a list holding one assistant message each), ``completion_ids`` (each
completion's token ids), one keyword per column of the prompt records
(:func:`theseus.posttraining.rl.prompts.reward_columns`), and TRL's helpers ``trainer_state`` (here
a :class:`RewardState` holding ``global_step`` alone), ``log_extra(column, values)`` and
``log_metric(name, value)``; so it ends with ``**kwargs``. It returns one number per completion,
``None`` for a completion it does not score. TRL's ``environments`` (tool environments), reward
models (``nn.Module``) and the rest of transformers' ``TrainerState`` are not passed.

Rewards combine as TRL's: the weighted sum over functions skipping ``None`` (NaN), and NaN where
no function scored a completion (unscorable: TRL leaves it out of the baseline and the logged
statistics).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from theseus.posttraining.rl.verifiers import accuracy, think_format

__all__ = [
    "RewardError",
    "RewardFunction",
    "RewardState",
    "Scores",
    "accuracy",
    "load_reward",
    "score",
    "think_format",
]
# Keywords every reward function receives; a column may not take one of these names.
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


class RewardError(ValueError):
    """A reward function failed or returned what cannot be a reward."""


@dataclass(frozen=True)
class RewardFunction:
    """A reward function and its name (``rewards/<name>/mean`` in the metrics)."""

    name: str
    fn: Callable[..., Any]

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> RewardFunction:
        """``fn`` named as TRL names it (``get_callable_name``): its ``__name__`` (a
        ``functools.partial``'s function's), else its class's name."""
        inner = fn
        while isinstance(inner, functools.partial):
            inner = inner.func
        return cls(getattr(inner, "__name__", type(inner).__name__), fn)


@dataclass(frozen=True)
class RewardState:
    """What ``trainer_state`` holds for a reward function: the step being scored (TRL passes
    transformers' ``TrainerState``, whose ``global_step`` shapes rewards by progress)."""

    global_step: int


@dataclass(frozen=True)
class Scores:
    """Each function's rewards (NaN where it returned None), their weighted sum ``total``
    (NaN where no function scored), what functions logged with ``log_metric`` (the mean of
    each name's values) and ``log_extra`` (per-completion columns)."""

    per_function: dict[str, np.ndarray]  # name -> (N,) float32
    total: np.ndarray  # (N,) float32
    logged: dict[str, float] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """TRL's reward metrics: ``rewards/<name>/mean`` and ``/std`` of each function and
        ``reward``, ``reward_std`` of the total, over the scored completions (NaN skipped; the
        standard deviation with Bessel's correction, NaN below two values), then the logged
        metrics."""
        found: dict[str, float] = {}
        for name, values in self.per_function.items():
            found[f"rewards/{name}/mean"] = _nanmean(values)
            found[f"rewards/{name}/std"] = _nanstd(values)
        found["reward"] = _nanmean(self.total)
        found["reward_std"] = _nanstd(self.total)
        return found | self.logged


def load_reward(spec: str) -> RewardFunction:
    """The function ``spec`` names: ``path/to/file.py:function`` (a path relative to the current
    directory, whose folder its imports search first) or ``package.module:function`` (the
    current directory searched first, as TRL's command line does)."""
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name:
        raise ValueError(
            f"reward {spec!r} names no function; give path/to/file.py:function or "
            "package.module:function (e.g. theseus.posttraining.rl.rewards:accuracy)"
        )
    module = _import_file(spec, Path(where)) if _is_path(where) else _import_module(spec, where)
    if not hasattr(module, name):
        found = sorted(
            key
            for key, value in vars(module).items()
            if callable(value) and not key.startswith("_") and not inspect.isclass(value)
        )
        raise ValueError(
            f"reward {spec!r}: {where} has no {name!r} (its functions: "
            f"{', '.join(found) or 'none'}); name one of them after the colon"
        )
    fn = getattr(module, name)
    if not callable(fn) or inspect.isclass(fn):
        raise ValueError(
            f"reward {spec!r}: {name!r} in {where} holds {type(fn).__name__} {_short(fn)}, not a "
            "function; name a function taking (prompts, completions, completion_ids, **kwargs)"
        )
    return RewardFunction.of(fn)


def score(
    functions: Sequence[RewardFunction],
    weights: Sequence[float] | None,
    *,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    step: int,
) -> Scores:
    """Score ``completions`` (one per row, its prompt in ``prompts``) with each function as TRL
    calls it, and combine them with ``weights`` (one per function; None: all 1, TRL's
    default). A function that raises or returns anything but one number or None per row is a
    :class:`RewardError`."""
    _check_inputs(functions, weights, prompts, completions, completion_ids, columns)
    count = len(prompts)
    logged: dict[str, list[float]] = {}
    extra: dict[str, list[Any]] = {}
    kwargs = {
        **columns,
        "trainer_state": RewardState(step),
        "log_extra": lambda column, values: extra.setdefault(column, []).extend(values),
        "log_metric": lambda name, value: logged.setdefault(name, []).append(float(value)),
    }
    outputs: dict[str, Any] = {}
    pending: dict[str, Any] = {}  # coroutines of async functions, awaited together
    try:
        for function in functions:
            with _blamed(function, step):
                output = function.fn(
                    prompts=prompts,
                    completions=completions,
                    completion_ids=completion_ids,
                    **kwargs,
                )
            (pending if inspect.isawaitable(output) else outputs)[function.name] = output
    except RewardError:
        for coroutine in pending.values():
            coroutine.close()
        raise
    if pending:
        outputs |= _await_all(pending, functions, step)
    per_function = {f.name: _rewards(outputs[f.name], f, step, count) for f in functions}
    weight = np.asarray([1.0] * len(functions) if weights is None else weights, np.float32)
    table = np.stack([per_function[f.name] for f in functions], axis=1)  # (N, functions)
    total = np.nansum(table * weight[None, :], axis=1).astype(np.float32)  # (N,)
    total[np.isnan(table).all(axis=1)] = np.nan
    means = {name: sum(values) / len(values) for name, values in logged.items() if values}
    return Scores(per_function, total, means, extra)


def _check_inputs(functions, weights, prompts, completions, completion_ids, columns) -> None:
    if not functions:
        raise ValueError("no reward function to score with; give at least one")
    names = [f.name for f in functions]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"two reward functions are named {', '.join(map(repr, twice))}, so their metrics "
            "(rewards/<name>/mean) would collide; give each function its own name"
        )
    if weights is not None and len(weights) != len(functions):
        raise ValueError(
            f"{len(weights)} reward weights for {len(functions)} reward functions "
            f"({', '.join(names)}); give one weight per function, in their order"
        )
    lengths = {"completions": len(completions), "completion_ids": len(completion_ids)}
    lengths |= {f"column {name!r}": len(values) for name, values in columns.items()}
    wrong = {what: n for what, n in lengths.items() if n != len(prompts)}
    if wrong:
        raise ValueError(
            f"{len(prompts)} prompts but {', '.join(f'{n} {w}' for w, n in wrong.items())}; "
            "give one prompt, completion, completion's ids and column value per row"
        )
    clash = sorted(set(columns) & set(RESERVED))
    if clash:
        raise ValueError(
            f"prompt columns {', '.join(map(repr, clash))} take the names of keywords every "
            f"reward function receives ({', '.join(RESERVED)}); rename them in the prompt file"
        )


@contextmanager
def _blamed(function: RewardFunction, step: int) -> Iterator[None]:
    """An exception of ``function`` as a :class:`RewardError` naming it and the step."""
    try:
        yield
    except Exception as error:
        raise RewardError(
            f"reward function {function.name!r} raised {type(error).__name__} at step {step}: "
            f"{error}; fix the function (it is called as TRL calls it: prompts=, completions=, "
            "completion_ids=, one keyword per prompt column, trainer_state=, log_extra=, "
            "log_metric=, so it needs **kwargs)"
        ) from error


def _await_all(pending: dict[str, Any], functions, step: int) -> dict[str, Any]:
    """The results of async reward functions, run together as TRL runs them."""
    by_name = {f.name: f for f in functions}

    async def run(name: str, coroutine) -> Any:
        with _blamed(by_name[name], step):
            return await coroutine

    async def together() -> list[Any]:
        return await asyncio.gather(*(run(n, c) for n, c in pending.items()))

    return dict(zip(pending, asyncio.run(together()), strict=True))


def _rewards(output: Any, function: RewardFunction, step: int, count: int) -> np.ndarray:
    """A function's output as (N,) float32 rewards, None as NaN, or a RewardError."""

    def refuse(what: str) -> RewardError:
        return RewardError(
            f"reward function {function.name!r} returned {what} at step {step}; it must return "
            f"a list of {count} rewards (one per completion), each a number or None"
        )

    if isinstance(output, np.ndarray) and output.ndim == 1:
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise refuse(f"{type(output).__name__} {_short(output)}")
    if len(output) != count:
        raise refuse(f"{len(output)} rewards for {count} completions")
    for index, value in enumerate(output):
        if value is not None and not isinstance(value, numbers.Real):
            raise refuse(f"{type(value).__name__} {_short(value)} for completion {index}")
    return np.asarray([np.nan if v is None else float(v) for v in output], np.float32)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _nanmean(values: np.ndarray) -> float:
    kept = values[~np.isnan(values)]
    return float(kept.mean()) if kept.size else float("nan")


def _nanstd(values: np.ndarray) -> float:
    """TRL's ``nanstd``: the standard deviation of the non-NaN values with Bessel's
    correction; NaN for fewer than two."""
    kept = values[~np.isnan(values)]
    return float(kept.std(ddof=1)) if kept.size > 1 else float("nan")


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise ValueError(
            f"reward {spec!r}: file {path} does not exist (paths are relative to the current "
            f"directory, {Path.cwd()}); give the path of the Python file that defines the function"
        )
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = f"theseus_reward_{resolved.stem}_{digest}"
    loader_spec = importlib.util.spec_from_file_location(name, resolved)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"reward {spec!r}: {path} is not a Python file; name a .py file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    try:
        with _searched_first(resolved.parent), _import_failure(spec, str(path)):
            loader_spec.loader.exec_module(module)
    except ValueError:
        del sys.modules[name]
        raise
    return module


def _import_module(spec: str, name: str):
    with _searched_first(Path.cwd()), _import_failure(spec, f"module {name}"):
        return importlib.import_module(name)


@contextmanager
def _searched_first(folder: Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while a reward's module is imported."""
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


@contextmanager
def _import_failure(spec: str, what: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        raise ValueError(
            f"reward {spec!r}: {what} cannot be imported ({type(error).__name__}: {error}); fix "
            "it, or give path/to/file.py:function or package.module:function"
        ) from error
