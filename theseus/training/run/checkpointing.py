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
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from theseus.checkpoint.checkpointer import Checkpointer, Restored
from theseus.checkpoint.fingerprints import fingerprints
from theseus.checkpoint.meta import CHECKPOINTS, CheckpointMeta
from theseus.sharding.layout import abstract_with
from theseus.training.finetune import Partition, is_adapter
from theseus.training.state import TrainState
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
    )


def saved_state(trainer: BaseTrainer, state: TrainState, base: dict | None) -> TrainState:
    """What a checkpoint holds of ``state``: without the frozen parameters when it has a base."""
    if base is None:
        return state
    return state.replace(params=trainer.partition.trained(state.params))


def base_record(
    trainer: BaseTrainer, params: Any, *, run_dir: Path | None, step: int | None
) -> dict | None:
    """The ``base`` of a run's checkpoints whose parameters start as ``params``: None when
    nothing is frozen."""
    frozen = trainer.partition.split(params)[1]
    if not frozen:
        return None
    return {
        "run_dir": None if run_dir is None else str(Path(run_dir).resolve()),
        "step": step,
        "seed": trainer.config.training.seed,
        "fingerprints": fingerprints(frozen),
    }


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


def frozen_params(trainer: BaseTrainer, base: dict, layout: Any) -> Any:
    """The frozen parameters a checkpoint's ``base`` points to, in ``layout``, after checking
    their fingerprints against those the run started from."""
    if base["run_dir"] is None:
        params = trainer.init_state(base["seed"]).params
        frozen = trainer.partition.split(params)[1]
        frozen = jax.device_put(frozen, trainer.partition.split(layout)[1])
        where = f"the initialisation of seed {base['seed']}"
    else:
        restored = read_base_params(trainer, base["run_dir"], layout, step=base["step"])
        frozen = trainer.partition.split(restored.state)[1]
        where = f"{base['run_dir']} (step {base['step']})"
    got = fingerprints(frozen)
    wrong = sorted(p for p, v in base["fingerprints"].items() if got.get(p) != v)
    wrong += sorted(p for p in got if p not in base["fingerprints"])
    if wrong:
        raise ValueError(
            f"the frozen base parameters from {where} are not those this run was trained on: "
            f"{len(wrong)} differ ({', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}). "
            "The base run was overwritten or changed; restore it, or start a new fine-tuning run."
        )
    return frozen


def restore_params(
    trainer: BaseTrainer,
    checkpointer: Checkpointer,
    layout: Any,
) -> Restored:
    """Every parameter of the newest good checkpoint in ``layout``: a checkpoint holding the
    trained ones alone is joined with its checked base."""
    restored = checkpointer.restore_params(None, lambda meta: params_target(trainer, layout, meta))
    return with_base(trainer, restored, layout)


def with_base(trainer: BaseTrainer, restored: Restored, layout: Any) -> Restored:
    """``restored`` parameters joined with the frozen ones of its base, if it has one."""
    if restored.meta.base is None:
        return restored
    frozen = frozen_params(trainer, restored.meta.base, layout)
    return dataclasses.replace(restored, state=trainer.partition.join(restored.state, frozen))
