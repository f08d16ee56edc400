"""A run's model with its newest good parameters, and its float32 logits under any policy.

:func:`load_run` reads the run's job from its checkpoint, builds its trainer for the run's
policy merged with the caller's changes (or a policy that fits the devices at hand), and restores
only the parameters into the layout asked for. :func:`logits` scores token ids: the parameters
stay in their storage layout and each layer is gathered inside the layer scan as in training, so
under FSDP the model is never whole on a device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.checkpoint.checkpointer import Checkpointer
from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import CHECKPOINTS, apply_overrides, validate
from theseus.inference.runs import reading_trainer
from theseus.jobs import get_job, legacy_job
from theseus.sharding.axis import Axis, ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training import gathering
from theseus.training.run.checkpointing import base_location, params_target, with_base
from theseus.training.trainer import BaseTrainer

Value = TypeVar("Value")  # what a function of the model returns: logits, scores


@dataclass(frozen=True)
class LoadedRun:
    """A run's trainer (for the requested policy), its newest good parameters, the metadata
    saved with them, the run's job and, for a fine-tuning run, the run its base comes from."""

    trainer: BaseTrainer
    params: Any
    meta: CheckpointMeta
    job: str
    base_dir: Path | None = None

    @property
    def step(self) -> int:
        return self.meta.step


def load_run(
    run_dir: str | Path,
    *,
    policy_changes: dict[str, Any] | None = None,
    devices: Sequence[jax.Device] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
    layout: Literal["compute", "storage"] = "compute",
) -> LoadedRun:
    """The newest good parameters of ``run_dir`` in the ``layout`` of the run's policy merged
    with ``policy_changes`` (a policy that fits ``devices`` when the run's does not and no
    layout change is given: :func:`theseus.inference.runs.reading_trainer`). The job is the one
    the checkpoint records (:func:`theseus.jobs.legacy_job` for a run saved before checkpoints
    recorded it), unless ``job`` names it; ``base`` is the base run of a fine-tuning run that
    moved apart from it (checked by its fingerprints)."""
    run_dir = Path(run_dir)
    if not (run_dir / CHECKPOINTS).is_dir():
        raise ValueError(
            f"{run_dir} holds no {CHECKPOINTS}/ folder: it is not the directory of a training "
            "run or an imported model, or the run saved no checkpoint yet"
        )
    with Checkpointer(run_dir / CHECKPOINTS, read_only=True) as checkpointer:
        meta = checkpointer.read_meta()  # its job, config and policy lay the parameters out
        name = job or meta.job or legacy_job(meta.config)
        trainer = _reading_trainer(name, meta, policy_changes, devices)
        target = params_target(trainer, getattr(trainer.layouts, layout), meta)
        restored = checkpointer.restore_params(None, target)
    # A fine-tuning checkpoint holds the trained parameters; its base holds the frozen ones.
    target = getattr(trainer.layouts, layout)
    base_dir = Path(base) if base else None
    found = (
        None if restored.meta.base is None else base_location(run_dir, restored.meta.base, base_dir)
    )
    restored = with_base(trainer, restored, target, run_dir=run_dir, base_dir=base_dir)
    return LoadedRun(trainer, restored.state, restored.meta, name, found)


def _reading_trainer(
    name: str,
    meta: CheckpointMeta,
    policy_changes: dict[str, Any] | None,
    devices: Sequence[jax.Device] | None,
) -> BaseTrainer:
    """The trainer of job ``name`` that reads a checkpoint saved with ``meta``: its config, its
    policy merged with ``policy_changes`` (or one that fits ``devices``), one example per replica
    (scoring and generation never split a training batch)."""
    trainer_class = get_job(name).trainer_class
    config = validate(trainer_class.config_class, meta.config)

    def config_for(topology: Topology) -> Any:
        batch = [f"training.batch_size={topology.replicas}", "training.per_device_batch_size=1"]
        return apply_overrides(config, batch)

    saved = validate(ShardingPolicy, meta.policy)
    return reading_trainer(trainer_class, config_for, saved, policy_changes, devices)


def check_token_ids(token_ids: Any, vocab_size: int) -> np.ndarray:
    """``token_ids`` as int32 (rows, seq): a non-empty rectangle of ids in the vocabulary."""
    try:
        ids = np.asarray(token_ids)
    except ValueError:
        ids = np.asarray([], dtype=object)
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            "token_ids must be a non-empty list of rows of int token ids, all rows of one length "
            f"(got shape {ids.shape}, dtype {ids.dtype})"
        )
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}), the model's vocabulary; got "
            f"{ids.min()}..{ids.max()}"
        )
    return ids.astype(np.int32)


def with_model(trainer: BaseTrainer, params: Any, fn: Callable[[Any], Value]) -> Value:
    """``fn`` of the trainer's model over storage-layout ``params``: each layer gathered inside
    the layer scan, as in the trainer's loss."""
    params = jax.lax.with_sharding_constraint(params, trainer.entry.layout)

    def run(p):
        return fn(nnx.merge(trainer.graphdef, p))

    return gathering.loss_with_layouts(run, params, trainer.layouts, None)


def model_logits(trainer: BaseTrainer, params: Any, tokens: jax.Array) -> jax.Array:
    """Float32 logits (rows, seq, vocab) of ``tokens`` from storage-layout ``params``
    (:func:`with_model`)."""
    return with_model(trainer, params, lambda model: model(tokens))


def logits(
    run_dir: str | Path,
    token_ids: Any,
    *,
    policy_changes: dict[str, Any] | None = None,
    devices: Sequence[jax.Device] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
) -> np.ndarray:
    """Float32 logits ``(rows, seq, vocab)`` of ``token_ids`` (rows, seq) under the newest good
    checkpoint of ``run_dir`` (a training run or an imported model), computed under the run's
    policy merged with ``policy_changes`` (e.g. ``{"tp": 2, "fsdp": True}``), or one that fits
    ``devices`` (see :func:`load_run`, which also says what ``job`` and ``base`` are)."""
    loaded = load_run(
        run_dir,
        layout="storage",
        policy_changes=policy_changes,
        devices=devices,
        job=job,
        base=base,
    )
    trainer = loaded.trainer
    decoder = trainer.decoder()
    if decoder is None:
        raise TypeError(
            f"{type(trainer).__name__} has no vocabulary to check token ids against: its "
            "decoder() returns None; override it (theseus.model.decode.Decoder)"
        )
    ids = check_token_ids(token_ids, decoder.vocab_size)
    rows, seq = ids.shape
    replicas = trainer.topology.replicas
    padded = np.zeros((math.ceil(rows / replicas) * replicas, seq), np.int32)
    padded[:rows] = ids
    mesh = trainer.topology.device_mesh
    row_sharding = NamedSharding(mesh, P(Axis.BATCH, None))
    with jax.set_mesh(mesh):
        score = jax.jit(
            lambda p, t: model_logits(trainer, p, t),
            in_shardings=(trainer.layouts.storage, row_sharding),
            out_shardings=NamedSharding(mesh, P(Axis.BATCH, None, None)),
        )
        out = score(loaded.params, jax.device_put(padded, row_sharding))
    return np.asarray(jax.device_get(out))[:rows]
