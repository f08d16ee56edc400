"""Parameters only, from the newest good checkpoint of a run, straight into a target layout.

Generation needs neither the optimizer state nor the step's data position, so it restores the
``params`` subtree of a checkpoint's ``state`` item alone (orbax partial restore): each device
reads only its own shards of the compute layout, and Adam's moments are never read. The
parameters are checked against the fingerprints saved with them, as a full restore checks them;
a damaged newest step falls back to the one before, and the fallback is logged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from theseus.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    IncompatibleCheckpointError,
    _compatibility_problems,
    fingerprints,
)

_PARAMS = "params"


@dataclass(frozen=True)
class RestoredParams:
    """Parameters of one checkpoint step and the metadata saved with it (policy, config, ...)."""

    params: Any
    step: int
    meta: dict


def read_meta(step_dir: Path) -> tuple[dict, dict[str, int]]:
    """The metadata and the per-array fingerprints saved with one checkpoint step."""
    payload = json.loads((step_dir / "meta" / "metadata").read_text())
    meta, prints = payload.get("meta"), payload.get("fingerprints")
    if not isinstance(meta, dict) or not isinstance(prints, dict):
        raise ValueError("its metadata lacks 'meta' or 'fingerprints'")
    return meta, prints


def restore_params(
    checkpoint_dir: str | Path,
    target_for: Callable[[dict], Any],
    *,
    log: Callable[[str], None] = print,
) -> RestoredParams:
    """The newest good step's parameters, restored into ``target_for(meta)``: a pytree of
    ``jax.ShapeDtypeStruct`` with shardings built from that step's metadata.

    Raises :class:`CheckpointError` when no step is good and :class:`IncompatibleCheckpointError`
    when a step's parameters have other paths or shapes than the target (another model).
    """
    checkpointer = Checkpointer(checkpoint_dir, read_only=True, log=log)
    steps = checkpointer.all_steps()
    checkpointer.close()
    if not steps:
        raise CheckpointError(
            f"no checkpoints in {checkpointer.directory}; train first (checkpoints are saved "
            "every checkpointing.interval steps and at the end)"
        )
    skipped = []
    for step in reversed(steps):
        step_dir = checkpointer.step_directory(step)
        try:
            meta, prints = read_meta(step_dir)
        except (OSError, ValueError) as error:
            skipped.append(f"step {step} ({error})")
            continue
        target = target_for(meta)
        try:
            params = _restore(step_dir / "state", target)
        except IncompatibleCheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many types
            skipped.append(f"step {step} ({type(error).__name__}: {str(error)[:200]})")
            continue
        got = fingerprints({_PARAMS: params})
        wrong = [path for path, value in got.items() if prints.get(path) != value]
        if wrong:
            skipped.append(f"step {step} (fingerprint mismatch: {', '.join(wrong[:3])})")
            continue
        if skipped:
            log(f"restored step {step}; skipped damaged " + "; ".join(skipped))
        return RestoredParams(params, step, meta)
    raise CheckpointError(f"no good checkpoint in {checkpointer.directory}: " + "; ".join(skipped))


def _restore(state_dir: Path, target: Any) -> Any:
    """The ``params`` subtree of a ``state`` item, read into ``target``'s shardings."""
    handler = ocp.PyTreeCheckpointHandler()
    saved = handler.metadata(state_dir)
    saved = getattr(saved, "tree", saved)[_PARAMS]
    problems = _compatibility_problems(saved, target)
    if problems:
        raise IncompatibleCheckpointError(
            f"checkpoint {state_dir.parent} holds other parameters than the model "
            f"({len(problems)} mismatching path(s)): " + "; ".join(problems[:5])
        )
    item = {_PARAMS: target}
    args = ocp.args.PyTreeRestore(
        item=item,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True,
    )
    return handler.restore(state_dir, args=args)[_PARAMS]
