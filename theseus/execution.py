"""Running jobs: the execution chain (an immutable builder) and the quick session.

Both hold one :class:`ShardingPolicy` for everything they run; ``.shard(...)`` merges into it
and must be called before a job is created, since the policy fixes the mesh and every layout.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from theseus.config import ConfigError, apply_overrides, read_yaml, validate, write_yaml
from theseus.jobs import Job, get_job, job_of_run
from theseus.sharding.axis import ShardingPolicy
from theseus.training.run.evaluation import check_base_model, run_config
from theseus.training.run.mode import NEW_RUN, RunMode
from theseus.training.trainer import BaseTrainer, TrainerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainStep:
    """One job of a chain with its own validated config."""

    job: str
    config: TrainerConfig

    @classmethod
    def new(cls, job_name: str, overrides: Sequence[str] = ()) -> ChainStep:
        job = get_job(job_name)
        return cls(job_name, apply_overrides(job.trainer_class.config_class(), overrides))


def step_dir(out_dir: Path, index: int, job_name: str) -> Path:
    return out_dir / f"{index:02d}-{job_name.replace('/', '-')}"


def run_trainer(
    job: Job,
    trainer: BaseTrainer,
    out_dir: str | Path,
    *,
    mode: RunMode = NEW_RUN,
    source_dir: str | Path | None = None,
) -> Any:
    """Train (as ``mode`` says) or evaluate with an already created trainer, as the job says."""
    from theseus.posttraining.rl.rollouts import rollout_data
    from theseus.training.run.evaluation import evaluate
    from theseus.training.run.loop import train

    if job.action == "train":
        evaluator = task_evaluator(trainer, out_dir, mode)
        data = rollout_data(trainer, Path(out_dir), base_dir=mode.init_from)
        return train(trainer, out_dir, mode=mode, evaluator=evaluator, data=data)
    data = rollout_data(trainer, Path(source_dir or out_dir))
    return evaluate(trainer, out_dir, source_dir=source_dir, data=data)


def task_evaluator(trainer: BaseTrainer, out_dir: str | Path, mode: RunMode) -> Any:
    """What scores ``evaluation.tasks`` during training (None when there are none); made, and
    so checked, before training starts."""
    if not trainer.config.evaluation.tasks:
        return None
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(
            "evaluation.tasks are scored by lm-evaluation-harness, which is not installed; "
            "install it with pip install -c constraints.txt -e '.[eval]', or set "
            "evaluation.tasks=[]"
        )
    from theseus.inference.tasks import TrainingEvaluation

    return TrainingEvaluation(trainer, Path(out_dir), base_dir=mode.init_from)


def run_job(
    job: Job, config: TrainerConfig, policy: ShardingPolicy, out_dir: str | Path, **options: Any
) -> Any:
    """Create the job's trainer (pre-flight checks included), then run it."""
    mode = options.get("mode", NEW_RUN)
    if job.action == "train" and mode.init_from is not None:
        check_base_model(config, mode.init_from)
    return run_trainer(job, job.trainer_class(config, policy), out_dir, **options)


@dataclass(frozen=True)
class Chain:
    """An immutable sequence of job steps sharing one sharding policy.

    ``theseus.chain("gpt/train/pretrain").shard(tp=2, fsdp=True).then("gpt/evaluate")``.
    Each step runs in its own folder of the chain's output directory; an ``evaluate`` step reads
    the checkpoints of the nearest training step before it.
    """

    steps: tuple[ChainStep, ...]
    policy: ShardingPolicy = field(default_factory=ShardingPolicy)
    imports: tuple[str, ...] = ()

    def then(self, job_name: str, *overrides: str) -> Chain:
        """Append a job. A job with the same config class as the last step starts from that
        step's config (evaluate the model just trained), then applies ``overrides``."""
        job = get_job(job_name)
        last = self.steps[-1].config
        base = last if type(last) is job.trainer_class.config_class else None
        step = ChainStep(
            job_name, apply_overrides(base or job.trainer_class.config_class(), overrides)
        )
        return replace(self, steps=(*self.steps, step))

    def shard(self, **changes: Any) -> Chain:
        """Merge ``changes`` into the chain's policy (validated now)."""
        return replace(self, policy=self.policy.merge(**changes))

    def configure(self, *overrides: str) -> Chain:
        """Apply dotted overrides to the last step's config."""
        last = self.steps[-1]
        changed = ChainStep(last.job, apply_overrides(last.config, overrides))
        return replace(self, steps=(*self.steps[:-1], changed))

    def to_dict(self) -> dict[str, Any]:
        return {
            "imports": list(self.imports),
            "sharding": self.policy.model_dump(),
            "steps": [
                {"job": s.job, "config": s.config.model_dump(mode="json")} for s in self.steps
            ],
        }

    def save(self, path: str | Path) -> None:
        write_yaml(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: Any, where: str = "chain") -> Chain:
        if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
            raise ConfigError(f"{where}: expected a mapping with a 'steps' list")
        unknown = set(data) - {"imports", "sharding", "steps"}
        if unknown:
            raise ConfigError(
                f"{where}: unknown keys {sorted(unknown)}; accepted: imports, sharding, steps"
            )
        imports = tuple(data.get("imports") or ())
        for module in imports:
            importlib.import_module(module)  # registers the user's jobs
        policy = validate(ShardingPolicy, data.get("sharding") or {})
        steps = []
        for index, item in enumerate(data["steps"]):
            if not isinstance(item, dict) or "job" not in item:
                raise ConfigError(f"{where}: step {index} needs a 'job' name")
            job = get_job(item["job"])
            steps.append(
                ChainStep(
                    item["job"], validate(job.trainer_class.config_class, item.get("config") or {})
                )
            )
        if not steps:
            raise ConfigError(f"{where}: a chain needs at least one step")
        return cls(tuple(steps), policy, imports)

    @classmethod
    def load(cls, path: str | Path) -> Chain:
        return cls.from_dict(read_yaml(path, "chain"), where=str(path))

    def run(
        self,
        out_dir: str | Path,
        *,
        mode: RunMode = RunMode(),
    ) -> list[Any]:
        """Run every step in order; returns each step's result. Each training step treats its
        folder as ``mode`` says (``mode=RunMode(resume=True)`` continues each one)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.save(out_dir / "chain.yaml")
        results, last_train_dir = [], None
        for index, step in enumerate(self.steps):
            job = get_job(step.job)
            directory = step_dir(out_dir, index, step.job)
            logger.info(f"chain step {index}: {step.job} in {directory}")
            results.append(
                run_job(
                    job,
                    step.config,
                    self.policy,
                    directory,
                    mode=mode,
                    source_dir=last_train_dir,
                )
            )
            if job.action == "train":
                last_train_dir = directory
        return results


def chain(job_name: str, *overrides: str) -> Chain:
    """Start an execution chain with one job (optionally with dotted config overrides)."""
    return Chain((ChainStep.new(job_name, overrides),))


class QuickSession:
    """One job, configured in Python and run in place.

    ``with theseus.quick("gpt/train/pretrain", out) as q: q.shard(tp=2); q.config...; q()``.
    What a training job does with a run already in ``out_dir`` is ``mode``, e.g.
    ``mode=RunMode(resume=True)``: see :class:`RunMode`. An evaluate job scores the run in
    ``out_dir``: ``q.config`` starts as that run's config (its ``config.yaml``), so the model is
    the run's; changes to the model section are refused when it runs. A training job started
    from another run's parameters (``mode=RunMode(init_from=BASE)``) takes BASE's model
    section the same way; ``job_name=None`` then means BASE's own job, and with
    ``mode=RunMode(resume=True)`` the job of the run in ``out_dir``.
    """

    def __init__(
        self,
        job_name: str | None,
        out_dir: str | Path,
        *,
        mode: RunMode = RunMode(),
    ):
        self.mode = mode
        base = mode.init_from
        if job_name is None and base is None and not mode.resume:
            raise ValueError("name the job to run (e.g. gpt/train/pretrain, see `theseus jobs`)")
        if job_name is None and base is None:  # resumed: the job of the run it continues
            mode.runs_to_replace(Path(out_dir))  # nothing to resume: that error first
            job_name = job_of_run(out_dir)
        if job_name is None:
            assert base is not None  # the first error above otherwise
            job_name = job_of_run(base)
        self.job = get_job(job_name)
        self.out_dir = Path(out_dir)
        config_class = self.job.trainer_class.config_class
        # An evaluation scores the run in out_dir: its config is the base of the user's changes.
        saved = run_config(config_class, out_dir) if self.job.action == "evaluate" else None
        # A run started from another run's parameters has that run's model.
        based = run_config(config_class, base) if base is not None else None
        self.config = saved or (config_class(model=based.model) if based else config_class())
        self.policy = ShardingPolicy()
        self.trainer: BaseTrainer | None = None

    def __enter__(self) -> QuickSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def shard(self, **changes: Any) -> QuickSession:
        if self.trainer is not None:
            raise ValueError(
                f"sharding must be configured before job creation: the {self.job.name!r} job "
                f"already built its mesh and layouts under {self.policy.describe()}. Call "
                "q.shard(...) before q() or q.create()."
            )
        self.policy = self.policy.merge(**changes)
        return self

    def override(self, *items: str) -> QuickSession:
        if self.trainer is not None:
            raise ConfigError(f"cannot apply overrides {list(items)}: {self._created()}")
        self.config = apply_overrides(self.config, items)
        return self

    def create(self) -> BaseTrainer:
        """Create the job: mesh, layouts and pre-flight checks (nothing allocated). The config
        is frozen from then on: the job's batch plan and layouts are fixed."""
        if self.trainer is None:
            if self.job.action == "train" and self.mode.init_from is not None:
                check_base_model(self.config, self.mode.init_from)
            self.trainer = self.job.trainer_class(self.config, self.policy)
            self.config.lock(self._created())
        return self.trainer

    def _created(self) -> str:
        return (
            f"the {self.job.name!r} job was already created with this config (its batch plan "
            "and layouts are fixed). Configure before q.create() or q(), or start a new quick "
            "session."
        )

    def __call__(self) -> Any:
        return run_trainer(self.job, self.create(), self.out_dir, mode=self.mode)


def quick(job_name: str | None, out_dir: str | Path, **options: Any) -> QuickSession:
    return QuickSession(job_name, out_dir, **options)
