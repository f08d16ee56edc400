"""The registry of named jobs (a trainer class and what to do with it: train or evaluate) and of
model families (each registers its jobs)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from theseus.config import read_yaml
from theseus.model.family import Family
from theseus.posttraining.preference.trainer import preference_trainer_class
from theseus.posttraining.rl.trainer import rl_trainer_class
from theseus.training.family import FamilyTrainer, trainer_class
from theseus.training.run.evaluation import RUN_CONFIG
from theseus.training.run.identity import record_training_job
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
    if action == "train":
        record_training_job(trainer_class, name)
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


# Runs saved before checkpoints and run.json recorded their job: a model section with one of
# these keys was written by that family's pretraining job (the only two families then).
_LEGACY_JOBS = (("n_embd", "gpt/train/pretrain"), ("hidden_size", "llama/train/pretrain"))


def legacy_job(config: Mapping[str, Any]) -> str:
    """The job of a run whose records name none (saved by a release before they did): GPT's
    pretraining job when its config's model section has ``n_embd``, Llama's when it has
    ``hidden_size``; otherwise the job must be named."""
    model = config.get("model") if isinstance(config, Mapping) else None
    for key, name in _LEGACY_JOBS:
        if isinstance(model, Mapping) and key in model:
            return name
    raise ValueError(
        "this run does not record its job and its model section is neither GPT's nor "
        "Llama's; name the job that trained it (--job NAME, job=NAME in Python)"
    )


def job_of_run(run_dir: str | Path) -> str:
    """The training job that wrote ``run_dir``: the one its ``run.json`` names, else (a run of
    a release before runs recorded it) :func:`legacy_job` of its ``config.yaml``."""
    run_dir = Path(run_dir)
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        record = {}
    name = record.get("job") if isinstance(record, dict) else None
    if isinstance(name, str):
        return name
    config_file = run_dir / RUN_CONFIG
    if not config_file.is_file():
        raise ValueError(
            f"{run_dir} is not a run directory: it holds neither run.json nor {RUN_CONFIG}"
        )
    return legacy_job(read_yaml(config_file, "run config") or {})


@dataclass(frozen=True)
class RegisteredFamily:
    """A registered model family: its ``name``, the ``jobs`` registering it made (training
    first), the dotted name of its ``module``, the :class:`~theseus.model.family.Family` it
    declares and its trainer class."""

    name: str
    jobs: tuple[str, ...]
    module: str
    family: Family = field(repr=False)
    trainer_class: type[FamilyTrainer] = field(repr=False)

    @property
    def train_job(self) -> str:
        return self.jobs[0]


_FAMILIES: dict[str, RegisteredFamily] = {}
#: The families theseus ships, by module; the registry is the only importer of these modules.
BUILTIN_FAMILIES = (
    "theseus.model.families.gpt",
    "theseus.model.families.llama",
    "theseus.model.families.olmo2",
    "theseus.model.families.gemma",
    "theseus.model.families.qwen3_moe",
    "theseus.model.families.olmoe",
    "theseus.model.families.mixtral",
)
_FAMILY_JOBS: tuple[tuple[str, Action], ...] = (
    ("train/pretrain", "train"),
    ("evaluate", "evaluate"),
    ("train/preference", "train"),
    ("train/rl", "train"),
)


def register_family(module: str) -> RegisteredFamily:
    """Import ``module`` (a dotted name), which defines ``FAMILY``, and register its jobs:
    ``NAME/train/pretrain`` and ``NAME/evaluate`` with the family's trainer class,
    ``NAME/train/preference`` with its preference trainer and ``NAME/train/rl`` with its RL
    trainer."""
    family = importlib.import_module(module).FAMILY
    if not isinstance(family, Family):
        raise TypeError(f"{module}.FAMILY is {family!r}, not a theseus.model.family.Family")
    existing = _FAMILIES.get(family.name)
    if existing is not None:
        if existing.module != module:
            raise ValueError(
                f"model family {family.name!r} is already registered from {existing.module}; "
                "choose another name"
            )
        return existing
    trainer = trainer_class(family)
    trainers = {
        "train/preference": preference_trainer_class(trainer),
        "train/rl": rl_trainer_class(trainer),
    }
    descriptions = {
        "train/preference": f"preference-tune the {family.name} family's model on chosen/rejected "
        "pairs (DPO, robust DPO, IPO, hinge, RPO, ORPO, SimPO)",
        "train/rl": f"online RL of the {family.name} family's model with verifiable rewards on "
        "prompts (GRPO, BNPO, Dr. GRPO, DAPO, CISPO, GSPO)",
        **family.descriptions,
    }
    jobs = tuple(f"{family.name}/{suffix}" for suffix, _ in _FAMILY_JOBS)
    for job, (suffix, action) in zip(jobs, _FAMILY_JOBS, strict=True):
        register_job(job, trainers.get(suffix, trainer), descriptions[suffix], action)
    registered = RegisteredFamily(family.name, jobs, module, family, trainer)
    _FAMILIES[family.name] = registered
    return registered


def families() -> dict[str, RegisteredFamily]:
    """The registered model families by name."""
    return dict(_FAMILIES)


def family_of(trainer_class: type[BaseTrainer]) -> RegisteredFamily | None:
    """The registered family whose model ``trainer_class`` trains (a subclass of a family's
    trainer too), or None for a trainer of its own model."""
    if not issubclass(trainer_class, FamilyTrainer):
        return None
    return next((f for f in _FAMILIES.values() if f.family is trainer_class.family), None)


for _module in BUILTIN_FAMILIES:
    register_family(_module)
