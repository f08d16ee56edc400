"""Where a run starts: a fresh state, the newest good checkpoint of the run (checked to continue
with the same numbers), or another run's parameters (``--init-from``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from theseus.checkpoint.checkpointer import Checkpointer
from theseus.training.run.checkpointing import (
    base_record,
    frozen_params,
    read_base_params,
    restore_target,
)
from theseus.training.run.mode import RunMode
from theseus.training.run.resume import Change, check_resume, resume_changes, resume_history
from theseus.training.state import TrainState
from theseus.training.trainer import BaseTrainer


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


def starting_point(
    trainer: BaseTrainer,
    checkpointer: Checkpointer,
    out_dir: Path,
    mode: RunMode,
) -> StartingPoint:
    """A fresh state, or the newest good checkpoint's state and data position (after the checks
    that the resumed run can continue with the same numbers), or with ``mode.init_from`` a fresh
    state holding another run's newest good parameters (other shapes: an error naming them)."""
    if mode.init_from is not None:
        storage = trainer.layouts.storage
        restored = read_base_params(trainer, mode.init_from, storage)
        fresh = trainer.init_state()  # fresh optimizer state and adapters
        params = _overlay(fresh.params, restored.state)
        base = base_record(
            trainer, params, run_dir=mode.init_from, step=restored.step, out_dir=out_dir
        )
        origin = f"parameters from {mode.init_from} (step {restored.step})"
        state = dataclasses.replace(fresh, params=params)
        return StartingPoint(state, first_step=1, data_position=0, resumed_from=origin, base=base)
    if not mode.resume:
        state = trainer.init_state()
        base = base_record(trainer, state.params, run_dir=None, step=None, out_dir=out_dir)
        return StartingPoint(state, first_step=1, data_position=0, base=base)
    restored = checkpointer.restore_state(None, lambda meta: restore_target(trainer, meta))
    state = restored.state
    if restored.meta.base is not None:  # the checkpoint holds the trained parameters alone
        storage = trainer.layouts.storage
        frozen = frozen_params(trainer, restored.meta.base, storage, run_dir=out_dir)
        state = state.replace(params=trainer.partition.join(state.params, frozen))
    meta = restored.meta
    changes = resume_changes(meta, trainer.config, trainer.execution_facts())
    check_resume(changes, f"{out_dir} from step {meta.step}", allow_changes=mode.allow_changes)
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
