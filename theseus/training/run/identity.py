"""What a run records about what it is: the registered training job of its trainer class, and
the tokenizer files it keeps.

The registry (:mod:`theseus.jobs`) tells this module, when a training job is registered, which
job a trainer class trains; every checkpoint (``CheckpointMeta.job``) and ``run.json`` of a run
then name that job, so reading a run never has to guess it from its config. A class registered
under several training jobs records the first; a class never registered records none (reading
such a run needs the job named: ``--job NAME``, ``job=NAME``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from theseus.tokenization.folder import TOKENIZER_FILES
from theseus.training.trainer import BaseTrainer

_JOB_OF_CLASS: dict[type[BaseTrainer], str] = {}


def record_training_job(trainer_class: type[BaseTrainer], name: str) -> None:
    """``name`` is the training job of ``trainer_class`` unless the class already has one."""
    _JOB_OF_CLASS.setdefault(trainer_class, name)


def job_of_trainer(trainer: BaseTrainer) -> str | None:
    """The training job of ``trainer``'s class (the class itself, not a base class)."""
    return _JOB_OF_CLASS.get(type(trainer))


def copy_tokenizer_files(source: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files of the run ``source`` into ``out_dir`` (those of
    :data:`~theseus.tokenization.folder.TOKENIZER_FILES` it has); returns their names."""
    copied = [name for name in TOKENIZER_FILES if (Path(source) / name).is_file()]
    for name in copied:
        shutil.copyfile(Path(source) / name, Path(out_dir) / name)
    return copied
