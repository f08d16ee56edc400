"""A run's records: ``run.json``, ``config.yaml``, ``layouts.txt`` (and the tokenizer), written by
the main process (the directory itself is prepared where the run starts:
:func:`theseus.training.run.start.prepare_run_dir`)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from theseus.accounting.memory import CompiledStep
from theseus.accounting.records import as_json
from theseus.config import save_yaml
from theseus.distributed.join import is_main_process
from theseus.training.run.data import RunData
from theseus.training.run.identity import job_of_trainer
from theseus.training.state import TrainState
from theseus.training.summary import layouts_text
from theseus.training.trainer import BaseTrainer


def write_run_record(
    trainer: BaseTrainer,
    out_dir: Path,
    *,
    data: RunData,
    state: TrainState,
    compiled: CompiledStep,
    resumes: list[dict],
    speed: dict,
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
        "data": data.description,
        **data.facts(),
        "resumes": resumes,
    }
    (out_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    save_yaml(trainer.config, out_dir / "config.yaml")
    if data.tokenizer is not None:  # `theseus generate` decodes with the run's own copy
        shutil.copyfile(data.tokenizer, out_dir / "tokenizer.json")
    (out_dir / "layouts.txt").write_text(layouts_text(trainer) + "\n")


def num_trained(trainer: BaseTrainer) -> int:
    """Parameters the run trains: all but the frozen ones (finetune)."""
    frozen = trainer.partition.frozen
    return sum(math.prod(x.shape) for x in trainer.abstract_leaves if x.path not in frozen)
