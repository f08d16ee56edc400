"""The registry of named jobs: a trainer class and what to do with it (train or evaluate)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from theseus.training.trainer import BaseTrainer

Action = Literal["train", "evaluate"]


@dataclass(frozen=True)
class Job:
    """A named, runnable unit: ``trainer_class`` built from its config, trained or evaluated."""

    name: str
    trainer_class: type[BaseTrainer]
    action: Action
    description: str


_JOBS: dict[str, Job] = {}


def register_job(
    name: str, trainer_class: type[BaseTrainer], description: str, action: Action = "train"
) -> Job:
    """Register ``trainer_class`` under ``name`` (e.g. ``mymodel/train``)."""
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, BaseTrainer):
        raise TypeError(f"job {name!r}: {trainer_class!r} is not a BaseTrainer subclass")
    if action not in ("train", "evaluate"):
        raise ValueError(f"job {name!r}: action must be 'train' or 'evaluate', got {action!r}")
    existing = _JOBS.get(name)
    if existing is not None and existing.trainer_class is not trainer_class:
        raise ValueError(
            f"job {name!r} is already registered for {existing.trainer_class.__name__}; "
            "choose another name"
        )
    job = Job(name, trainer_class, action, description)
    _JOBS[name] = job
    return job


def register(
    name: str, description: str, action: Action = "train"
) -> Callable[[type[BaseTrainer]], type[BaseTrainer]]:
    """Class decorator form of :func:`register_job`."""

    def decorate(trainer_class: type[BaseTrainer]) -> type[BaseTrainer]:
        register_job(name, trainer_class, description, action)
        return trainer_class

    return decorate


def get_job(name: str) -> Job:
    try:
        return _JOBS[name]
    except KeyError:
        known = ", ".join(sorted(_JOBS)) or "(none)"
        raise ValueError(
            f"unknown job {name!r}; registered jobs: {known} (see `theseus jobs`; register your "
            "own with theseus.register)"
        ) from None


def all_jobs() -> list[Job]:
    return [_JOBS[name] for name in sorted(_JOBS)]


def _register_builtin() -> None:
    from theseus.training.gpt import GPTTrainer
    from theseus.training.llama import LlamaTrainer

    register_job("gpt/train/pretrain", GPTTrainer, "pretrain GPT on byte or token data")
    register_job(
        "gpt/evaluate",
        GPTTrainer,
        "validation loss of the latest GPT checkpoint of a run",
        action="evaluate",
    )
    register_job(
        "llama/train/pretrain",
        LlamaTrainer,
        "train a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on byte or token data",
    )
    register_job(
        "llama/evaluate",
        LlamaTrainer,
        "validation loss of the latest Llama-family checkpoint of a run",
        action="evaluate",
    )


_register_builtin()
