"""Evaluation of a run's newest good checkpoint, and what an evaluate job (and a run started with
``--init-from``) takes from the run it reads: the run's own config (``config.yaml``, written by
every training run and by ``theseus import-hf``) as the base under the user's overrides, and a
model section that must stay the run's, refused field by field before anything is restored."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax

from theseus.checkpoint.checkpointer import Checkpointer
from theseus.config import CHECKPOINTS, ConfigError, ConfigT, read_yaml, validate
from theseus.distributed.join import is_main_process
from theseus.training.run.checkpointing import restore_params, restore_reference
from theseus.training.run.data import CorpusData, RunData, load_data
from theseus.training.trainer import BaseTrainer, TrainerConfig

RUN_CONFIG = "config.yaml"


def run_config(config_class: type[ConfigT], run_dir: str | Path) -> ConfigT | None:
    """The config ``run_dir`` was trained (or imported) with, as ``config_class``; None when the
    folder holds no ``config.yaml``. A run of another job is an error that says so."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        return validate(config_class, read_yaml(path, "run config") or {})
    except ConfigError as error:
        first = str(error).split("; ")[0]
        raise ConfigError(
            f"{run_dir} is not a run of this job's model family: its {RUN_CONFIG} does not fit "
            f"{config_class.__name__} ({first}); evaluate it with the evaluate job of the family "
            "that trained it (`theseus jobs` lists them)"
        ) from None


def model_changes(given: TrainerConfig, run: TrainerConfig, whose: str = "the run's") -> list[str]:
    """Each ``model.*`` field where ``given`` differs from ``run``, with both values."""
    ours, theirs = given.model.model_dump(mode="json"), run.model.model_dump(mode="json")
    return [
        f"model.{name}={ours[name]!r} ({whose}: {theirs[name]!r})"
        for name in ours
        if ours[name] != theirs[name]
    ]


def check_same_model(config: TrainerConfig, source: str | Path) -> None:
    """Refuse to evaluate ``source`` with a model other than its own: restoring would fail on
    shapes or, worse, score a different function with the run's weights."""
    saved = run_config(type(config), source)
    if saved is None:
        return
    changes = model_changes(config, saved)
    if changes:
        raise ValueError(
            f"cannot evaluate {source} with another model: {'; '.join(changes)}. An evaluation "
            f"takes the model section from the run's {RUN_CONFIG}; drop these overrides"
        )


def check_base_model(config: TrainerConfig, base_dir: str | Path) -> None:
    """Refuse to start from ``base_dir``'s parameters (``--init-from``) with a model other
    than the base run's own, field by field, before anything is restored."""
    saved = run_config(type(config), base_dir)
    if saved is None:
        return
    changes = model_changes(config, saved, "the base's")
    if changes:
        raise ValueError(
            f"cannot start from {base_dir} with another model: {'; '.join(changes)}. A run "
            f"started with --init-from takes the model section from the base's {RUN_CONFIG}; "
            "drop these overrides"
        )


@dataclass(frozen=True)
class EvalResult:
    """Validation loss of a checkpoint."""

    out_dir: str
    source: str
    step: int
    val_loss: float | None  # None: the data has no loss (RL's held-out prompts)
    val_loss_by_source: dict[str, float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the loss's others (rewards/...)

    def describe(self) -> str:
        return (
            f"evaluated {self.source} at step {self.step}: "
            f"{score_text(self.val_loss, self.metrics)}; written to {self.out_dir}/eval.json"
        )


def score_text(val_loss: float | None, metrics: dict[str, float]) -> str:
    """What an evaluation scored, in words: its validation loss, or (an RL run's held-out
    prompts, which have none) their mean reward."""
    if val_loss is not None:
        return f"validation loss {val_loss:.4f}"
    return f"held-out reward {metrics.get('reward', float('nan')):.4f}"


def evaluate(
    trainer: BaseTrainer,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    base_dir: Path | None = None,
    data: RunData | None = None,
) -> EvalResult:
    """Validation loss of the newest good checkpoint in ``source_dir`` (default: ``out_dir``),
    restored into this trainer's layouts (a fine-tuning run's base found as
    ``checkpointing.base_location`` says, ``base_dir`` naming it); written to
    ``out_dir/eval.json``. ``data``: what is held out (default: the run's corpus; an RL run's
    held-out prompts, scored by their rewards). The caller reports the result
    (``EvalResult.describe``) once."""
    out_dir = Path(out_dir)
    source = Path(source_dir) if source_dir is not None else out_dir
    if not (source / CHECKPOINTS).is_dir():
        raise ValueError(
            f"nothing to evaluate: {source} holds no {CHECKPOINTS}/ folder; train first or give "
            "the run directory of a training job"
        )
    check_same_model(trainer.config, source)
    corpus = load_data(trainer) if data is None else None
    # Read-only: a training job may still be saving there.
    with Checkpointer(source / CHECKPOINTS, read_only=True) as checkpointer:
        storage = trainer.layouts.storage
        restored = restore_params(trainer, checkpointer, storage, base_dir=base_dir)
        reference = restore_reference(trainer, checkpointer, restored.step)
    if corpus is not None:  # a preference run's held-out rows carry the reference
        data = CorpusData.of(trainer, trainer.for_evaluation(corpus, restored.state, source))
    assert data is not None
    validated = data.validate(restored.state, reference)
    on_device = validated.by_source
    by_source = None if on_device is None else {k: float(v) for k, v in on_device.items()}
    metrics = {name: float(value) for name, value in jax.device_get(validated.means).items()}
    val_loss = None if validated.loss is None else float(validated.loss)
    result = EvalResult(str(out_dir), str(source), restored.step, val_loss, by_source, metrics)
    if is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eval.json").write_text(
            json.dumps({**asdict(result), "policy": trainer.policy.model_dump()}, indent=2) + "\n"
        )
    return result
