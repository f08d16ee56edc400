"""What a training job does with a run directory that may already hold a run: start it, continue
it (``resume``, optionally accepting changed settings) or replace it (``overwrite``), and whether
a new run starts from another run's parameters (``init_from``). One object,
:class:`RunMode`, passed whole from the command line or the Python API down to the loop; every
check of what the user asked for lives here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from theseus.config import CHECKPOINTS

# Files a run writes: an output directory holding any of them holds a run.
RUN_FILES = (
    "run.json",
    "metrics.jsonl",
    "config.yaml",
    "layouts.txt",
    CHECKPOINTS,
    "eval.json",
    "tokenizer.json",
    "wandb-run.json",  # training/run/wandb_writer.py
    "wandb",
    "tensorboard",  # training/run/tensorboard.py
)


@dataclass(frozen=True)
class RunMode:
    """``resume``: continue from the newest good checkpoint of the run directory;
    ``allow_changes``: with ``resume``, accept settings that change the numbers (see
    :mod:`theseus.training.run.start`); ``overwrite``: replace a run already there. Neither
    flag: the directory must not hold a run yet. ``init_from``: a new run starts from the newest
    good parameters of that run directory (trained or imported by ``theseus import-hf``), with a
    fresh optimizer and its own schedule."""

    resume: bool = False
    overwrite: bool = False
    allow_changes: bool = False
    init_from: Path | None = None

    def __post_init__(self) -> None:
        for name in ("resume", "overwrite", "allow_changes"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume and --overwrite (resume=True, overwrite=True) contradict each other; "
                "choose one"
            )
        if self.init_from is not None:
            object.__setattr__(self, "init_from", Path(self.init_from))
            if self.resume:
                raise ValueError(
                    "--init-from starts a new run and --resume continues one: choose one"
                )
            if not (self.init_from / CHECKPOINTS).is_dir():
                raise ValueError(
                    f"--init-from {self.init_from}: it holds no {CHECKPOINTS}/ folder; give the "
                    "directory of a training run or of `theseus import-hf`"
                )
        if self.allow_changes and not self.resume:
            raise ValueError(
                "--allow-changes (allow_changes=True) applies to --resume only: add --resume, or "
                "drop --allow-changes"
            )

    def runs_to_replace(self, out_dir: Path) -> list[Path]:
        """The files of an earlier run in ``out_dir`` that this run replaces (none when it
        resumes), after refusing to mix two runs in one directory unless the user said how."""
        present = [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]
        if self.resume:
            if not (out_dir / CHECKPOINTS).is_dir():
                raise ValueError(
                    f"nothing to resume in {out_dir}: it holds no {CHECKPOINTS}/ folder; start a "
                    "new run without --resume"
                )
            return []
        if present and not self.overwrite:
            raise ValueError(
                f"{out_dir} already holds a run ({', '.join(p.name for p in present)}); pass "
                "--resume to continue it, --overwrite to replace it, or choose another output "
                "directory"
            )
        return present


#: A new run: the output directory must not hold one yet.
NEW_RUN = RunMode()
