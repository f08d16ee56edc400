"""A run's records: its directory prepared (and a replaced run cleared) on every process, and
``run.json``, ``config.yaml``, ``layouts.txt`` (and the tokenizer) written by the main one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from theseus.accounting.memory import CompiledStep
from theseus.accounting.records import as_json
from theseus.config import save_yaml
from theseus.data import Mixture
from theseus.distributed.join import is_main_process
from theseus.training.run.identity import copy_tokenizer_files, job_of_trainer
from theseus.training.run.mode import RunMode
from theseus.training.state import TrainState
from theseus.training.summary import layouts_text
from theseus.training.trainer import BaseTrainer


def sync_processes(name: str) -> None:
    """Wait until every process of a multi-process run reaches this point."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def prepare_run_dir(out_dir: Path, mode: RunMode) -> None:
    """Check the run directory against ``mode`` (see :meth:`RunMode.runs_to_replace`), then clear
    a run it replaces; a run started from another run's parameters (``mode.init_from``) keeps
    that run's tokenizer files.

    Every process checks before any of them writes (process 0 then clears an overwritten run),
    so the check never sees a run that this very job has begun.
    """
    replaced = mode.runs_to_replace(out_dir)
    sync_processes("theseus: run directory checked")
    if is_main_process():
        for path in replaced:  # none when resuming
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
        if mode.init_from is not None:
            copy_tokenizer_files(mode.init_from, out_dir)
    sync_processes("theseus: run directory ready")


def write_run_record(
    trainer: BaseTrainer,
    out_dir: Path,
    *,
    corpus: Mixture,
    state: TrainState,
    compiled: CompiledStep,
    resumes: list[dict],
    speed: dict,
    data: dict,
) -> None:
    """``run.json``, ``config.yaml`` and ``layouts.txt`` (main process), from the trainer."""
    if not is_main_process():
        return
    record = {
        "job": job_of_trainer(trainer),
        **trainer.execution_facts(),
        **speed,
        "num_params": trainer.num_params,
        "num_trained_params": num_trained(trainer),
        "memory_per_device": {
            "predicted": as_json(trainer.memory()),
            "measured": as_json(trainer.measured_memory(state)),
        },
        "compiled_step_memory_per_device": as_json(compiled),
        "data": corpus.description,
        **data,
        "resumes": resumes,
    }
    (out_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    save_yaml(trainer.config, out_dir / "config.yaml")
    if corpus.tokenizer is not None:  # `theseus generate` decodes with the run's own copy
        shutil.copyfile(corpus.tokenizer, out_dir / "tokenizer.json")
    (out_dir / "layouts.txt").write_text(layouts_text(trainer) + "\n")


def num_trained(trainer: BaseTrainer) -> int:
    """Parameters the run trains: all but the frozen ones (finetune)."""
    frozen = trainer.partition.frozen
    return sum(math.prod(x.shape) for x in trainer.abstract_leaves if x.path not in frozen)
