"""Hugging Face ``config.json`` to a theseus job and model section, and back, through the
registered families' Hugging Face specs (:class:`theseus.model.family.HFSpec`).

A family reads both layouts transformers writes (4.x, which most published checkpoints have, and
5.x) and refuses anything its model cannot reproduce exactly, naming the key. Mixture-of-experts
configs and model types no family declares are refused here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from theseus.jobs import RegisteredFamily, families, family_of
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
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    experts = [key for key in _EXPERT_KEYS if hf.get(key)]
    types = supported()
    if model_type not in types or experts:
        what = f"model_type {model_type!r}" + (f" with experts ({experts[0]})" if experts else "")
        raise ValueError(
            f"{where}: {what} (architectures {architectures}) is not supported; theseus imports "
            f"{', '.join(types)} (dense decoders)"
        )
    family = types[model_type]
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
