"""Resuming with changed settings: which changes keep a resumed run equal to one that never
stopped, and which are refused unless the user accepts them (``--allow-changes``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from theseus.accounting.records import as_json
from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import Section, validate

# Keys (or key prefixes ending in ".") whose change keeps the numbers of the steps: how the same
# global batch is split over devices, how long to train, what to validate, score, log and save,
# what to do about non-finite steps, and which dtype FSDP gathers in. Any other change
# (optimizer, schedule, data, seed, model, batch size, dtype) makes the resumed run differ from
# an uninterrupted one.
ACCEPTED = (
    "training.steps",
    "training.per_device_batch_size",
    "training.validation_interval",
    "training.validation_batches",
    "training.nonfinite",
    "training.max_skipped_steps",
    "training.gather_dtype",  # the same values gathered, cast before or after the gather
    "logging.",
    "checkpointing.",
    "evaluation.",
)
# Execution facts saved with a checkpoint that may differ on resume (restored into new layouts).
EXECUTION_KEYS = ("policy", "mesh_shape", "num_devices", "num_processes")
ABSENT = "<absent>"


@dataclass(frozen=True)
class Change:
    """One setting that differs between a checkpoint and the resuming run."""

    key: str
    old: Any
    new: Any

    @property
    def accepted(self) -> bool:
        return self.key in EXECUTION_KEYS or any(
            self.key == a or (a.endswith(".") and self.key.startswith(a)) for a in ACCEPTED
        )

    def describe(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_diff(old: Mapping, new: Mapping) -> list[Change]:
    """Every dotted key whose value differs between two nested configs, in sorted order."""
    old_flat, new_flat = _flatten(old), _flatten(new)
    return [
        Change(key, old_flat.get(key, ABSENT), new_flat.get(key, ABSENT))
        for key in sorted(old_flat.keys() | new_flat.keys())
        if old_flat.get(key, ABSENT) != new_flat.get(key, ABSENT)
    ]


def saved_config(config_class: type[Section], saved: Mapping) -> Mapping:
    """A checkpoint's config in the form this version writes it: settings added since it was
    saved take their defaults (nobody set them, so nothing changed). A config that no longer
    validates (a setting removed or renamed) is compared as saved, so the diff names the key."""
    try:
        return validate(config_class, saved).model_dump(mode="json")
    except ValueError:
        return saved


def resume_changes(saved: CheckpointMeta, config: Section, facts: Mapping) -> list[Change]:
    """Changes from a checkpoint's metadata to the resuming run's config and execution facts."""
    changes = config_diff(saved_config(type(config), saved.config), config.model_dump(mode="json"))
    saved_facts = as_json(saved)
    changes += [
        Change(key, saved_facts[key], facts[key])
        for key in EXECUTION_KEYS
        if saved_facts[key] != facts[key]
    ]
    return changes


def check_resume(changes: list[Change], where: str, *, allow_changes: bool) -> None:
    """Refuse changes that break exactness unless ``allow_changes``."""
    refused = [c for c in changes if not c.accepted]
    if refused and not allow_changes:
        raise ValueError(
            f"resuming {where} with changed settings that make the run differ from one that "
            "never stopped: "
            + "; ".join(c.describe() for c in refused)
            + ". Pass --allow-changes (allow_changes=True in Python) to accept them (run.json "
            "records them), or resume with the saved values."
        )


def resume_history(run_json: Path, step: int, changes: list[Change]) -> list[dict]:
    """The ``resumes`` list of ``run.json``: the earlier ones, then this resume from ``step``."""
    earlier = []
    if run_json.is_file():
        try:
            earlier = list(json.loads(run_json.read_text()).get("resumes", []))
        except (json.JSONDecodeError, AttributeError, TypeError):
            earlier = []
    entry = {"from_step": step, "changes": [asdict(c) for c in changes]}
    return [*earlier, entry]
