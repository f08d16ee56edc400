"""What a training run's checkpoints hold besides the arrays, and where restored arrays land:
the helpers that know about :class:`TrainState` (the :class:`~theseus.checkpoint.checkpointer.Checkpointer`
itself stores any pytree).

A run with frozen parameters (fine-tuning, :mod:`theseus.training.finetune`) saves its trained
parameters and their optimizer state alone; the checkpoint's ``base`` points to the frozen ones
(the ``--init-from`` run and step, or the seed's initialisation) with their fingerprints, which
every read of the checkpoint (resume, evaluation, scoring, generation, export) checks.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from theseus.checkpoint.checkpointer import Checkpointer, Restored
from theseus.checkpoint.fingerprints import fingerprints
from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import CHECKPOINTS
from theseus.sharding.layout import abstract_with
from theseus.training.finetune import Partition, is_adapter
from theseus.training.run.identity import job_of_trainer
from theseus.training.state import TrainState, reference_of
from theseus.training.trainer import BaseTrainer


def restore_target(trainer: BaseTrainer, meta: CheckpointMeta | None = None) -> TrainState:
    """The trainer's abstract state with its state layout: where restored arrays must land
    (the trained parameters alone for a checkpoint ``meta`` that points to a base)."""
    target = abstract_with(trainer.abstract_state, trainer.state_layout)
    if meta is None or meta.base is None:
        return target
    return target.replace(params=trainer.partition.trained(target.params))


def params_target(trainer: BaseTrainer, layout: Any, meta: CheckpointMeta) -> Any:
    """Where a checkpoint's parameters land in ``layout``: all, or the trained alone."""
    target = abstract_with(trainer.abstract_state.params, layout)
    return target if meta.base is None else trainer.partition.trained(target)


def checkpoint_meta(
    trainer: BaseTrainer, *, step: int, data_position: int, base: dict | None = None
) -> CheckpointMeta:
    """What a checkpoint of ``step`` records besides the state: enough to resume and to audit
    the run. ``data_position`` is the index of the next training example to draw (the loop's
    position after step ``step``); ``base`` points to the frozen parameters (see above)."""
    return CheckpointMeta(
        step=int(step),
        data_position=int(data_position),
        config=trainer.config.model_dump(mode="json"),
        **trainer.execution_facts(),
        base=base,
        job=job_of_trainer(trainer),
    )


def saved_state(trainer: BaseTrainer, state: TrainState, base: dict | None) -> TrainState:
    """What a checkpoint holds of ``state``: without the frozen parameters when it has a base."""
    if base is None:
        return state
    return dataclasses.replace(state, params=trainer.partition.trained(state.params))


def base_record(
    trainer: BaseTrainer, params: Any, *, run_dir: Path | None, step: int | None, out_dir: Path
) -> dict | None:
    """The ``base`` of the checkpoints in ``out_dir`` of a run whose parameters start as
    ``params`` (from the run ``run_dir``, or the seed's initialisation when None): None when
    nothing is frozen. The base run is recorded relative to ``out_dir`` where it can be, so
    the two folders can move together."""
    frozen = trainer.partition.split(params)[1]
    if not frozen:
        return None
    return {
        "run_dir": None if run_dir is None else _relative_to(Path(run_dir), Path(out_dir)),
        "step": step,
        "seed": trainer.config.training.seed,
        "fingerprints": fingerprints(frozen),
    }


def _relative_to(path: Path, start: Path) -> str:
    """``path`` relative to the folder ``start``, or absolute where no relative path exists
    (another drive)."""
    try:
        return os.path.relpath(path.resolve(), start.resolve())
    except ValueError:
        return str(path.resolve())


def base_location(run_dir: Path, base: dict, given: Path | None = None) -> Path | None:
    """The run holding the frozen parameters of ``run_dir``'s checkpoint ``base`` (None: the
    seed's initialisation): ``given`` (``--base DIR``) when the user names it, else the recorded
    path, relative to ``run_dir``. An absolute path (as releases before relative paths recorded
    it) that no longer exists is looked up as the folder of its name beside ``run_dir``, where a
    base copied together with its fine-tuning run lands. The base's fingerprints check the
    folder found (:func:`frozen_params`)."""
    if base["run_dir"] is None:
        if given is not None:
            why = f"its frozen parameters are the initialisation of seed {base['seed']}"
            raise unused_base(run_dir, given, why)
        return None
    if given is not None:
        return Path(given)
    recorded = Path(base["run_dir"])
    candidates = [run_dir / recorded]
    if recorded.is_absolute():
        candidates.append(Path(run_dir).absolute().parent / recorded.name)
    for candidate in candidates:
        if (candidate / CHECKPOINTS).is_dir():
            return candidate
    raise ValueError(
        f"the base of the fine-tuning run {run_dir}, recorded as {base['run_dir']}, is not "
        f"found ({' or '.join(os.path.normpath(c) for c in candidates)} hold no {CHECKPOINTS}/): "
        "it was moved apart from the run or removed. Point to it with --base DIR (base=DIR in "
        "Python); its fingerprints check that it is the base this run was trained on."
    )


def read_base_params(
    trainer: BaseTrainer,
    run_dir: Path,
    layout: Any,
    *,
    step: int | None = None,
) -> Restored:
    """Every parameter of ``trainer`` but its LoRA adapters from run ``run_dir`` (newest good
    step, or ``step``), float32 as runs store them, in ``layout``; the frozen ones are then
    cast to the trainer's ``frozen_dtype`` (an ``--init-from`` start, or a checkpoint's base)."""
    base_paths = {leaf.path for leaf in trainer.abstract_leaves if not is_adapter(leaf.path)}
    keep = Partition(frozenset(base_paths))  # split: (adapters, base)
    abstract = keep.split(trainer.abstract_state.params)[1]
    float32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), abstract)
    target = abstract_with(float32, keep.split(layout)[1])
    with Checkpointer(Path(run_dir) / CHECKPOINTS, read_only=True) as other:
        restored = other.restore_params(step, target)
    trained, frozen = trainer.partition.split(restored.state)
    dtype = trainer.frozen_dtype
    frozen_layout = trainer.partition.split(layout)[1]
    cast = jax.jit(
        lambda tree: jax.tree.map(lambda p: p.astype(dtype), tree),
        out_shardings=frozen_layout,
        donate_argnums=0,
    )
    frozen = cast(frozen) if frozen else frozen
    return dataclasses.replace(restored, state=trainer.partition.join(trained, frozen))


def frozen_params(
    trainer: BaseTrainer, base: dict, layout: Any, *, run_dir: Path, base_dir: Path | None = None
) -> Any:
    """The frozen parameters the ``base`` of a checkpoint of ``run_dir`` points to (found by
    :func:`base_location`, ``base_dir`` naming the base run), in ``layout``, after checking
    their fingerprints against those the run started from."""
    found = base_location(Path(run_dir), base, base_dir)
    if found is None:
        params = trainer.init_state(base["seed"]).params
        frozen = trainer.partition.split(params)[1]
        frozen = jax.device_put(frozen, trainer.partition.split(layout)[1])
        where = f"the initialisation of seed {base['seed']}"
    else:
        restored = read_base_params(trainer, found, layout, step=base["step"])
        frozen = trainer.partition.split(restored.state)[1]
        where = f"{os.path.normpath(found)} (step {base['step']})"
    got = fingerprints(frozen)
    wrong = sorted(p for p, v in base["fingerprints"].items() if got.get(p) != v)
    wrong += sorted(p for p in got if p not in base["fingerprints"])
    if wrong:
        raise ValueError(
            f"the frozen base parameters from {where} are not those this run was trained on: "
            f"{len(wrong)} differ ({', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}). "
            "It is another base, or the base run was overwritten or changed; point to the base "
            "the run was trained on (--base DIR, base=DIR in Python), or start a new "
            "fine-tuning run."
        )
    return frozen


def restore_params(
    trainer: BaseTrainer,
    checkpointer: Checkpointer,
    layout: Any,
    *,
    base_dir: Path | None = None,
) -> Restored:
    """Every parameter of the newest good checkpoint in ``layout``: a checkpoint holding the
    trained ones alone is joined with its checked base (``base_dir``: see :func:`with_base`)."""
    target = params_target(trainer, layout, checkpointer.read_meta())
    restored = checkpointer.restore_params(None, target)
    run_dir = checkpointer.directory.parent
    return with_base(trainer, restored, layout, run_dir=run_dir, base_dir=base_dir)


def restore_reference(trainer: BaseTrainer, checkpointer: Checkpointer, step: int) -> Any:
    """The frozen reference copy of the starting parameters that the checkpoint of ``step``
    holds, in the storage layout, for a trainer whose state holds one
    (:attr:`BaseTrainer.holds_reference`); else None."""
    reference = reference_of(trainer.abstract_state)
    if reference is None:
        return None
    target = abstract_with(reference, trainer.layouts.storage)
    return checkpointer.restore_entry(step, target, "reference").state


def with_base(
    trainer: BaseTrainer,
    restored: Restored,
    layout: Any,
    *,
    run_dir: Path,
    base_dir: Path | None = None,
) -> Restored:
    """``restored`` parameters of a checkpoint of ``run_dir`` joined with the frozen ones of
    its base, if it has one (found where :func:`base_location` says, ``base_dir`` naming it)."""
    if restored.meta.base is None:
        if base_dir is not None:
            raise unused_base(run_dir, base_dir, "it trained every parameter, so it has no base")
        return restored
    frozen = frozen_params(trainer, restored.meta.base, layout, run_dir=run_dir, base_dir=base_dir)
    return dataclasses.replace(restored, state=trainer.partition.join(restored.state, frozen))


def unused_base(run_dir: Path, given: Path, why: str) -> ValueError:
    """The error for ``--base`` (``base=``) given to read a run that reads no base run."""
    return ValueError(
        f"--base {given} (base= in Python) names the base run of a fine-tuning run, but "
        f"{run_dir} reads none: {why}; drop --base"
    )
