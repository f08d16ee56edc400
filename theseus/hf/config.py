"""Hugging Face ``config.json`` to a theseus job and model section, and back, through the
registered families' Hugging Face specs (:class:`theseus.model.family.HFSpec`).

A family reads both layouts transformers writes (4.x, which most published checkpoints have, and
5.x) and refuses anything its model cannot reproduce exactly, naming the key. Mixture-of-experts
configs and model types no family declares are refused here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from theseus.config import ConfigT, validate
from theseus.jobs import RegisteredFamily, families, family_of, get_job
from theseus.training.trainer import BaseTrainer

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelSpec:
    """What a Hugging Face config becomes: the theseus job, its ``model`` section and the
    Hugging Face model type it came from."""

    job: str
    model: dict[str, Any]
    model_type: str
    special_tokens: dict[str, Any]
    family: RegisteredFamily = field(repr=False)


def supported() -> dict[str, RegisteredFamily]:
    """Every model type a registered family reads, and that family."""
    return {t: f for f in families().values() for t in f.family.hf.model_types}


def model_spec(hf: dict[str, Any], where: str) -> ModelSpec:
    """The theseus job and model section of a Hugging Face config (``where`` names its file)."""
    model_type = str(hf.get("model_type"))
    architectures = hf.get("architectures") or []
    types = supported()
    family = types.get(model_type)
    reads_experts = family is not None and "num_experts" in family.family.config_class.model_fields
    experts = [key for key in _EXPERT_KEYS if hf.get(key) and not reads_experts]
    if family is None or experts:
        what = f"model_type {model_type!r}" + (f" with experts ({experts[0]})" if experts else "")
        raise ValueError(
            f"{where}: {what} (architectures {architectures}) is not supported; theseus imports "
            f"{', '.join(types)}"
        )
    wanted = family.family.hf.architectures[model_type]
    if architectures and wanted not in architectures:
        raise ValueError(
            f"{where}: architectures {architectures}: theseus imports {wanted} for {model_type}"
        )
    tokens = {key: hf[key] for key in SPECIAL_TOKENS if hf.get(key) is not None}
    try:
        model = family.family.hf.from_hf(hf, model_type, where)
    except KeyError as error:
        raise ValueError(f"{where}: required key {error.args[0]!r} is missing") from None
    return ModelSpec(family.train_job, model, model_type, tokens, family)


def read_config(path: str | Path) -> ModelSpec:
    """The model of a Hugging Face ``config.json``: the file, or the folder that holds it (no
    weights are read)."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(
            f"{path} is neither a Hugging Face config.json nor a folder holding one; give the "
            "file or the model's folder"
        )
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON: {error}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_file} holds {type(hf).__name__}, not a config object")
    return model_spec(hf, str(config_file))


def job_for(spec: ModelSpec, job: str | None) -> str:
    """The job that trains ``spec``'s model: ``job`` when it is one of the model's family's
    (an error naming both families otherwise), else the family's training job."""
    if job is None:
        return spec.job
    found = family_of(get_job(job).trainer_class)
    if found is not spec.family:
        theirs = "a model of its own" if found is None else f"the {found.name} family"
        raise ValueError(
            f"job {job!r} trains {theirs}, but the Hugging Face config is a {spec.model_type} "
            f"model of the {spec.family.name} family; drop the job or give one of "
            f"{', '.join(spec.family.jobs)}."
        )
    return job


def with_model(config: ConfigT, spec: ModelSpec) -> ConfigT:
    """``config`` with its ``model`` section replaced by ``spec``'s."""
    return validate(type(config), config.model_dump() | {"model": spec.model})


def trainer_family(trainer: BaseTrainer) -> RegisteredFamily:
    """The family of a run's trainer; a trainer of a model of its own has no Hugging Face form."""
    found = family_of(type(trainer))
    if found is None:
        known = ", ".join(families())
        raise ValueError(
            f"{type(trainer).__name__} trains a model of its own, not one of the registered "
            f"model families ({known}), so it has no Hugging Face form; export a family's run."
        )
    return found


def export_model_type(family: RegisteredFamily, model: dict[str, Any], imported: str | None) -> str:
    """The Hugging Face model type a run of ``family`` exports as (``imported``: the type it was
    imported from, or None)."""
    return family.family.hf.export_type(model, imported)


def hf_config(
    family: RegisteredFamily, model: dict[str, Any], model_type: str, dtype: str
) -> dict[str, Any]:
    """A transformers 5.x ``config.json`` for a theseus model section."""
    spec = family.family.hf
    base = {"architectures": [spec.architectures[model_type]], "model_type": model_type}
    return base | {"dtype": dtype} | spec.to_hf(model, model_type)
