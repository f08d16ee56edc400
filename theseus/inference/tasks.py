"""A run scored on lm-evaluation-harness's tasks (``theseus evaluate RUN_DIR --tasks ...``).

The tasks are checked before the model loads (each name known to the harness or found in the
include path, each dataset loadable), so bad input stops with one paragraph and writes nothing.
Results are written by the harness's own ``EvaluationTracker`` (``results_<date>.json``, and
``samples_<task>_<date>.jsonl`` with per-request samples) under ``OUTPUT/step<N>/`` and printed
with its ``make_table``, as its ``lm_eval run`` command writes and prints them.
"""

from __future__ import annotations

import difflib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lm_eval
import numpy as np
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table, sanitize_model_name

from theseus.config import is_int
from theseus.distributed.join import is_main_process
from theseus.inference.harness import HarnessModel, TheseusLM, find_tokenizer
from theseus.training.trainer import BaseTrainer

logger = logging.getLogger(__name__)

#: Where results go in the run directory unless ``output_path`` says otherwise.
RESULTS_DIR = "harness"


@dataclass(frozen=True)
class TaskScores:
    """What :func:`evaluate_tasks` returns: the harness's results (without samples), its tables
    and the files written."""

    results: dict[str, Any]
    table: str
    files: list[str]

    def describe(self) -> str:
        written = ", ".join(self.files) if self.files else "nothing (not the main process)"
        return f"{self.table}\nwritten: {written}"


def task_manager(tasks: Sequence[str], include_path: str | Path | None) -> TaskManager:
    """The harness's task index for ``tasks``: the include path alone when it holds them all
    (indexing the harness's ~15,000 own tasks takes seconds), else both; unknown names are an
    error naming them."""
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ValueError(
                f"--include-path {include_path} is not a folder; give the folder of your task "
                "YAML files"
            )
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if not _unknown(local, tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = _unknown(manager, tasks)
    if unknown:
        known = manager.all_tasks
        hints = {name: difflib.get_close_matches(name, known, n=3) for name in unknown}
        close = "; ".join(f"{n}: did you mean {', '.join(h)}?" for n, h in hints.items() if h)
        where = "" if include_path is None else f" nor in --include-path {include_path}"
        raise ValueError(
            f"unknown task(s) {', '.join(unknown)}: not among the harness's {len(known)} tasks, "
            f"groups and tags{where}{'; ' + close if close else ''}. `lm_eval ls tasks` lists "
            "them; define your own as YAML files in a folder given with --include-path"
        )
    return manager


def _unknown(manager: TaskManager, tasks: Sequence[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [name for name in tasks if name not in known]


def check_datasets(manager: TaskManager, tasks: Sequence[str]) -> None:
    """Load each task (and so its dataset); one that fails is an error naming it."""
    for name in tasks:
        try:
            manager.load([name])
        except Exception as error:  # noqa: BLE001 - datasets and the hub raise many kinds
            raise ValueError(
                f"task {name}: its dataset could not be loaded ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else 'no message'}). "
                "Offline (HF_DATASETS_OFFLINE=1), a dataset must already be in the Hugging Face "
                "datasets cache; download it once with network access, or point the task's "
                "dataset_path at local files"
            ) from None


def evaluate_tasks(
    run_dir: str | Path,
    tasks: Sequence[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_path: str | Path | None = None,
    log_samples: bool = False,
    output_path: str | Path | None = None,
    policy_changes: dict[str, Any] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
    batch_size: int | None = None,
) -> TaskScores:
    """Score the newest good checkpoint of ``run_dir`` on the harness's ``tasks`` (names, groups
    or tags; ``include_path`` adds a folder of task YAML files) under the run's policy merged
    with ``policy_changes``; results (and, with ``log_samples``, per-request samples) go to
    ``output_path`` (default ``RUN_DIR/harness``), as the harness writes them."""
    run_dir = Path(run_dir)
    tasks = [t.strip() for t in tasks if t.strip()]
    if not tasks:
        raise ValueError("--tasks names no task; give harness task names, e.g. arc_easy,hellaswag")
    for name, value in (("limit", limit), ("num_fewshot", num_fewshot)):
        if value is not None and not is_int(value):
            raise TypeError(f"{name}={value!r} must be an int")
    manager = task_manager(tasks, include_path)
    check_datasets(manager, tasks)
    lm = TheseusLM(run_dir, job=job, base=base, batch_size=batch_size, **(policy_changes or {}))
    tracker = EvaluationTracker(output_path=str(output_path or run_dir / RESULTS_DIR))
    results = run_harness(
        lm,
        tasks,
        manager,
        model_args={"run": str(run_dir), **(policy_changes or {})},
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=log_samples,
        evaluation_tracker=tracker,
    )
    if results is None or not is_main_process():
        return TaskScores({}, "", [])
    samples = results.pop("samples", None)
    # Results of a checkpoint go to a folder named by its step (the harness names it by model).
    name = f"step{lm.model.info['step']}"
    tracker.general_config_tracker.model_name = name
    tracker.general_config_tracker.model_name_sanitized = sanitize_model_name(name)
    folder = Path(tracker.output_path) / name
    before = set(folder.glob("*")) if folder.is_dir() else set()
    tracker.save_results_aggregated(results=results, samples=samples if log_samples else None)
    if log_samples:
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    files = sorted(str(p) for p in set(folder.glob("*")) - before)
    config = results["config"]
    table = (
        f"theseus ({config['model_args']}), gen_kwargs: ({config['gen_kwargs']}), limit: "
        f"{limit}, num_fewshot: {num_fewshot}, batch_size: {lm.scorer.rows}\n" + make_table(results)
    )
    if "groups" in results:
        table += "\n" + make_table(results, "groups")
    return TaskScores(results, table, files)


def run_harness(lm: TheseusLM, tasks: Sequence[str], manager: TaskManager, **options: Any) -> Any:
    """``lm_eval.simple_evaluate`` of ``lm`` on ``tasks`` with the harness's default seeds,
    leaving the process's own random states as they were (a training run's go on unchanged);
    torch, which theseus does not use, is neither imported nor seeded."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        return lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=manager, torch_random_seed=None, **options
        )
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def task_scores(results: dict[str, Any]) -> dict[str, float]:
    """The harness's metrics as ``task/metric`` (``task/metric,filter`` for a filter other than
    ``none``), without standard errors and sample counts."""
    scores = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, comma, kind = key.partition(",")  # a metric's key names its filter
            if not comma or "_stderr" in metric or not isinstance(value, int | float):
                continue
            scores[f"{task}/{metric}" + ("" if kind == "none" else f",{kind}")] = value
    return scores


class TrainingEvaluation:
    """Scores ``evaluation.tasks`` on a training run's live parameters (storage layout, on the
    training mesh: no second copy of the model for scoring): the tasks and the tokenizer are
    checked when it is made, before training starts; each call scores one step."""

    def __init__(self, trainer: BaseTrainer, out_dir: Path, *, base_dir: Path | None = None):
        settings = trainer.config.evaluation
        self.tasks = list(settings.tasks)
        self.limit = settings.limit
        self.manager = task_manager(self.tasks, settings.include_path)
        check_datasets(self.manager, self.tasks)
        run_dirs = [Path(out_dir), *([Path(base_dir)] if base_dir else [])]
        tokenizer = find_tokenizer(run_dirs, trainer.config.data.path)
        info = {"run": str(out_dir), "policy": trainer.policy.describe()}
        self.lm = TheseusLM.of(HarnessModel(trainer, None, tokenizer, info))

    def __call__(self, params: Any, step: int) -> dict[str, float]:
        model = self.lm.model
        self.lm.use(replace(model, params=params, info=model.info | {"step": step}))
        try:
            results = run_harness(
                self.lm,
                self.tasks,
                self.manager,
                limit=self.limit,
                bootstrap_iters=0,  # the scores alone: no standard errors, no samples kept
                log_samples=False,
            )
        finally:
            self.lm.use(replace(model, params=None))  # the step's parameters are not kept
        return task_scores(results)
