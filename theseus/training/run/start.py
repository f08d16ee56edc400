"""How a run starts, decided in one place: the run directory checked against what the user asked
for (:class:`~theseus.training.run.mode.RunMode`) and prepared, and the state the loop starts
from: fresh, the newest good checkpoint of the run (on any mesh and layout, checked to continue
with the same numbers: which changed settings a resume accepts is below), or another run's
parameters (``--init-from``).

The path reads top-down: :func:`started` checks and prepares the directory, opens the run's
checkpointer, reads the newest step's metadata once, decides the restore target by it, and
restores once (a fine-tuning run's frozen parameters then come from its base run). No module it
calls calls back into this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from theseus.accounting.records import as_json
from theseus.checkpoint.checkpointer import Checkpointer
from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import CHECKPOINTS, Section, validate
from theseus.distributed.join import is_main_process
from theseus.training.run.checkpointing import (
    base_record,
    frozen_params,
    read_base_params,
    restore_target,
)
from theseus.training.run.identity import copy_tokenizer_files
from theseus.training.run.mode import RunMode
from theseus.training.state import TrainState
from theseus.training.trainer import BaseTrainer

# --- the run directory ---------------------------------------------------------------------------


def prepare_run_dir(out_dir: Path, mode: RunMode) -> None:
    """Check the run directory against ``mode`` (see :meth:`RunMode.runs_to_replace`), then clear
    a run it replaces; a run started from another run's parameters (``mode.init_from``) keeps
    that run's tokenizer files.

    Every process checks before any of them writes (process 0 then clears an overwritten run),
    so the check never sees a run that this very job has begun.
    """
    replaced = mode.runs_to_replace(out_dir)
    _sync_processes("theseus: run directory checked")
    if is_main_process():
        for path in replaced:  # none when resuming
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
        if mode.init_from is not None:
            copy_tokenizer_files(mode.init_from, out_dir)
    _sync_processes("theseus: run directory ready")


def _sync_processes(name: str) -> None:
    """Wait until every process of a multi-process run reaches this point."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# --- where the run starts ------------------------------------------------------------------------


@dataclass(frozen=True)
class StartingPoint:
    """Where a run (or a resumed run segment) begins; a resumed one says from where, with which
    changed settings, and the run's resume history."""

    state: TrainState
    first_step: int
    data_position: int
    resumed_from: str | None = None
    changes: tuple[Change, ...] = ()
    resumes: list[dict] = field(default_factory=list)
    base: dict | None = None  # where its frozen parameters come from (checkpointing.base_record)


@contextlib.contextmanager
def started(
    trainer: BaseTrainer, out_dir: Path, mode: RunMode
) -> Iterator[tuple[Checkpointer, StartingPoint]]:
    """The run's checkpointer (open while the run lasts) and its starting point, after the run
    directory is checked against ``mode`` and prepared (:func:`prepare_run_dir`). Every process
    of a multi-process run calls it: all restore, the main one writes."""
    prepare_run_dir(out_dir, mode)
    saving = trainer.config.checkpointing
    with Checkpointer(
        out_dir / CHECKPOINTS, keep=saving.keep, async_save=saving.async_save
    ) as checkpointer:
        yield checkpointer, _starting_point(trainer, checkpointer, out_dir, mode)


def _starting_point(
    trainer: BaseTrainer, checkpointer: Checkpointer, out_dir: Path, mode: RunMode
) -> StartingPoint:
    """A fresh state, another run's parameters (``mode.init_from``), or the newest good
    checkpoint of the run (``mode.resume``)."""
    if mode.init_from is not None:
        return _from_run(trainer, mode.init_from, out_dir)
    if mode.resume:
        return _resumed(trainer, checkpointer, out_dir, allow_changes=mode.allow_changes)
    state = trainer.init_state()
    base = base_record(trainer, state.params, run_dir=None, step=None, out_dir=out_dir)
    return StartingPoint(state, first_step=1, data_position=0, base=base)


def _from_run(trainer: BaseTrainer, source: Path, out_dir: Path) -> StartingPoint:
    """A fresh state (optimizer state and adapters) holding the newest good parameters of the
    run ``source``; other shapes are an error naming them."""
    restored = read_base_params(trainer, source, trainer.layouts.storage)
    fresh = trainer.init_state()
    params = _overlay(fresh.params, restored.state)
    base = base_record(trainer, params, run_dir=source, step=restored.step, out_dir=out_dir)
    origin = f"parameters from {source} (step {restored.step})"
    state = trainer.with_reference_params(dataclasses.replace(fresh, params=params))
    return StartingPoint(state, first_step=1, data_position=0, resumed_from=origin, base=base)


def _resumed(
    trainer: BaseTrainer, checkpointer: Checkpointer, out_dir: Path, *, allow_changes: bool
) -> StartingPoint:
    """The newest good checkpoint's state and data position, in this run's layouts: its
    metadata decides the target (the trained parameters alone when it has a base), the restore
    falls back past a damaged step, and the restored step's settings are checked against this
    run's before its base is read."""
    target = restore_target(trainer, checkpointer.read_meta())
    restored = checkpointer.restore_state(None, target)
    meta = restored.meta
    changes = resume_changes(meta, trainer.config, trainer.execution_facts())
    check_resume(changes, f"{out_dir} from step {meta.step}", allow_changes=allow_changes)
    state = restored.state
    if meta.base is not None:  # the checkpoint holds the trained parameters alone
        frozen = frozen_params(trainer, meta.base, trainer.layouts.storage, run_dir=out_dir)
        state = state.replace(params=trainer.partition.join(state.params, frozen))
    return StartingPoint(
        state,
        first_step=meta.step + 1,
        data_position=meta.data_position,
        resumed_from=(
            f"resumed from step {meta.step} (saved under {meta.policy} on mesh "
            f"{meta.mesh_shape}), data position {meta.data_position}"
        ),
        changes=tuple(changes),
        resumes=resume_history(out_dir / "run.json", meta.step, changes),
        base=meta.base,
    )


def _overlay(params: dict, restored: dict) -> dict:
    """``params`` with every leaf that ``restored`` holds replaced by it (nested dicts)."""
    out = dict(params)
    for key, value in restored.items():
        out[key] = _overlay(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


# --- resuming with changed settings: which keep the run equal to one that never stopped ----------

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
