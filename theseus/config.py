"""Typed job configuration, grouped by component, with dotted ``key=value`` overrides and YAML."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeGuard, TypeVar

import numpy as np
import pydantic
import yaml

#: The dtype FSDP gathers parameters in (``training.gather_dtype``).
GatherDtype = Literal["compute", "storage"]


class ConfigError(ValueError):
    """A configuration key or value a user gave cannot be used."""


class Section(pydantic.BaseModel):
    """A group of settings: unknown keys and wrong types are errors; assignments are validated,
    and refused once the section is locked (:meth:`lock`; not ``freeze``, which names the
    ``finetune.freeze`` setting)."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)
    # (dotted path of this section, why it is frozen) once frozen; copies are never frozen.
    _frozen: tuple[str, str] | None = pydantic.PrivateAttr(default=None)

    def lock(self, because: str, *, path: str = "") -> None:
        """Refuse every later assignment to this section and the sections in it, saying
        ``because``: a job built from this config would silently ignore the change."""
        for name, value in self.__dict__.items():
            if isinstance(value, Section):
                value.lock(because, path=f"{path}{name}.")
        self._frozen = (path, because)

    def __setattr__(self, name: str, value: Any) -> None:
        frozen = (getattr(self, "__pydantic_private__", None) or {}).get("_frozen")
        if frozen is not None and not name.startswith("_"):
            path, because = frozen
            raise ConfigError(f"cannot set {path}{name} = {value!r}: {because}")
        # Pydantic keeps a value that fails a whole-section check; put the old one back.
        previous = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
        except pydantic.ValidationError:
            if name in self.__dict__:
                self.__dict__[name] = previous
            raise


class TrainingConfig(Section):
    """How many examples, steps and which numeric precision."""

    batch_size: int = pydantic.Field(32, gt=0, description="global examples per optimizer step")
    per_device_batch_size: int = pydantic.Field(
        8, gt=0, description="examples per replica per microbatch (accumulation is derived)"
    )
    seq_len: int | None = pydantic.Field(
        None, gt=0, description="tokens per example; None means the model's context length"
    )
    steps: int = pydantic.Field(200, gt=0, description="optimizer steps to train")
    seed: int = pydantic.Field(0, description="seed of the initial parameters and data order")
    dtype: Literal["float32", "bfloat16"] = pydantic.Field(
        "float32", description="compute dtype; parameters and gradient sums stay float32"
    )
    gather_dtype: GatherDtype = pydantic.Field(
        "compute",
        description="dtype of FSDP's parameter gathers: compute (each shard cast before the "
        "gather, half the bytes under bfloat16; the same values, since the layer casts them "
        "anyway) or storage (float32); gradients reduce in float32 either way",
    )
    loss_chunk: int | None = pydantic.Field(
        None,
        gt=0,
        description="positions of a row whose logits the loss computes at once (the head and the "
        "cross-entropy run a chunk at a time); None: the largest power of two whose float32 "
        "logits per device fit in 256 MiB, the whole row when it is shorter",
    )
    validation_interval: int = pydantic.Field(
        50, gt=0, description="run validation every this many steps (and at the last step)"
    )
    validation_batches: int = pydantic.Field(
        4, gt=0, description="held-out batches (of batch_size examples) averaged per validation"
    )
    nonfinite: Literal["stop", "skip"] = pydantic.Field(
        "stop",
        description="a step whose loss or gradient norm is not finite: stop the run, or skip "
        "its update and go on",
    )
    max_skipped_steps: int = pydantic.Field(
        5, gt=0, description="with nonfinite=skip, stop after this many skipped steps in a row"
    )


class OptimizationConfig(Section):
    """AdamW with global-norm clipping, linear warmup and cosine decay."""

    learning_rate: float = pydantic.Field(3e-3, gt=0, description="peak learning rate")
    warmup_steps: int = pydantic.Field(20, ge=0, description="linear warmup from 0 to the peak")
    min_learning_rate_ratio: float = pydantic.Field(
        0.1, ge=0, le=1, description="final learning rate as a fraction of the peak"
    )
    weight_decay: float = pydantic.Field(0.1, ge=0, description="decoupled decay on matrices")
    b1: float = pydantic.Field(0.9, gt=0, lt=1)
    b2: float = pydantic.Field(0.95, gt=0, lt=1)
    eps: float = pydantic.Field(1e-8, gt=0)
    grad_clip: float = pydantic.Field(1.0, gt=0, description="global gradient norm limit")


class DataSource(Section):
    """One source of a weighted mixture: a corpus path, its weight and the name its validation
    loss is reported under (default: the path's last component)."""

    path: str = pydantic.Field(description="any corpus data.path accepts")
    weight: float = pydantic.Field(
        gt=0, allow_inf_nan=False, description="share of the examples, before normalising"
    )
    name: str | None = pydantic.Field(None, description="name in val_loss_by_source")

    @pydantic.model_validator(mode="after")
    def _default_name(self) -> DataSource:
        if self.name is None:
            self.__dict__["name"] = Path(self.path.rstrip("/")).name or self.path
        return self


class DataConfig(Section):
    """Where tokens come from: one path, a weighted mixture of sources, or neither for the
    built-in dataset (no download)."""

    path: str | None = pydantic.Field(
        None,
        description="text, JSON Lines or Parquet file or folder, tokenized folder, or .bin; "
        "None: built-in",
    )
    sources: list[DataSource] | None = pydantic.Field(
        None,
        description="weighted mixture, PATH:WEIGHT,PATH:WEIGHT or a list of {path, weight, name}",
    )
    validation_fraction: float = pydantic.Field(0.1, gt=0, lt=1)
    token_dtype: Literal["uint16", "uint32"] = pydantic.Field(
        "uint16", description="element type of a .bin token file"
    )
    text_field: str = pydantic.Field(
        "text", description="text field of JSON Lines records and column of Parquet files"
    )
    overlong: Literal["truncate", "drop", "error"] = pydantic.Field(
        "error",
        description="a chat or completion example longer than training.seq_len + 1 tokens: "
        "keep its first tokens, leave it out, or stop with an error",
    )
    document_masking: bool = pydantic.Field(
        False,
        description="a tokenized pretraining stream's documents (ended by its end-of-text "
        "token) attend within themselves only, at positions that restart",
    )

    @pydantic.field_validator("sources", mode="before")
    @classmethod
    def _parse_sources(cls, value: Any) -> Any:
        """``PATH_A:0.7,PATH_B:0.3`` (the command-line form) as a list of sources."""
        if not isinstance(value, str):
            return value
        sources = []
        for item in value.split(","):
            path, sep, weight = item.strip().rpartition(":")
            if not sep or not path:
                raise ValueError(
                    f"source {item!r} is not PATH:WEIGHT; write data.sources=PATH_A:0.7,PATH_B:0.3"
                )
            sources.append({"path": path, "weight": weight})
        return sources

    @pydantic.model_validator(mode="after")
    def _one_kind(self) -> DataConfig:
        if self.sources is not None:
            if self.path is not None:
                raise ValueError(
                    "data.path and data.sources are both set; give one (a single path is a "
                    "one-source mixture)"
                )
            if not self.sources:
                raise ValueError("data.sources is empty; give at least one PATH:WEIGHT")
            names = [s.name for s in self.sources]
            if len(set(names)) < len(names):
                raise ValueError(
                    f"data.sources names {names} repeat; give each source its own name"
                )
        return self


class WandbConfig(Section):
    """Weights & Biases tracking (needs the wandb package): off unless ``project`` is given."""

    project: str | None = pydantic.Field(
        None, description="W&B project to log the run to; None: no W&B run"
    )
    entity: str | None = pydantic.Field(None, description="W&B team or user; None: your default")
    name: str | None = pydantic.Field(None, description="run name; None: W&B picks one")
    group: str | None = pydantic.Field(None, description="group the run with others (W&B group)")
    tags: list[str] = pydantic.Field(default_factory=list, description="W&B tags of the run")
    mode: Literal["online", "offline"] = pydantic.Field(
        "online", description="online, or offline: write OUT/wandb only (upload: wandb sync)"
    )


class LoggingConfig(Section):
    """What the main process shows while training."""

    log_interval: int = pydantic.Field(10, gt=0, description="print a metrics line this often")
    progress_bar: bool = pydantic.Field(True, description="show a progress bar with ETA")
    tensorboard: bool = pydantic.Field(
        False, description="write TensorBoard events to OUT/tensorboard (needs tensorboardX)"
    )
    peak_tflops: float | None = pydantic.Field(
        None, gt=0, description="peak TFLOP/s per device for MFU; None: the built-in table"
    )
    wandb: WandbConfig = pydantic.Field(
        default_factory=WandbConfig, description="Weights & Biases (logging.wandb.project)"
    )


class EvaluationConfig(Section):
    """lm-evaluation-harness tasks scored on the live parameters while training (needs the
    ``eval`` extra and a tokenizer): each score goes to the step's row of metrics.jsonl."""

    tasks: list[str] = pydantic.Field(
        default_factory=list, description="harness task names to score; empty: none"
    )
    interval: int = pydantic.Field(
        100, gt=0, description="score the tasks every this many steps (and at the last step)"
    )
    include_path: str | None = pydantic.Field(
        None, description="a folder of your own task YAML files"
    )
    limit: int | None = pydantic.Field(
        None, gt=0, description="score at most this many documents a task; None: all"
    )


#: The folder of a run directory that holds its checkpoints (one folder per committed step);
#: here, below every layer, so the supervisor of a multi-process job can name it too.
CHECKPOINTS = "checkpoints"


class CheckpointingConfig(Section):
    """Orbax checkpoints of the whole training state, saved asynchronously."""

    interval: int = pydantic.Field(100, gt=0, description="save every this many steps")
    keep: int = pydantic.Field(3, gt=0, description="keep the newest this many checkpoints")
    async_save: bool = pydantic.Field(True, description="save in the background")


ConfigT = TypeVar("ConfigT", bound=pydantic.BaseModel)


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """Whether ``value`` is an int: a Python or NumPy integer, never a bool (``True`` is an int
    to Python, never a count or a seed to a user)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """Refuse a ``value`` that is not an int (:func:`is_int`) in ``[minimum, maximum]``:
    ``TypeError`` for the type, ``ValueError`` for the range, each naming ``name``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def apply_overrides(config: ConfigT, overrides: Sequence[str]) -> ConfigT:
    """A copy of ``config`` with dotted overrides such as ``training.batch_size=16`` applied."""
    data = config.model_dump()
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        node = data
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                prefix = ".".join(parts[:depth]) or "the top level"
                accepted = ", ".join(sorted(node)) if isinstance(node, dict) else "(none)"
                raise ConfigError(
                    f"unknown config key {key!r} (in override {item!r}): {prefix} has no "
                    f"{part!r}; accepted keys there: {accepted}"
                )
            if depth == len(parts) - 1:
                node[part] = _parse_value(raw)
            else:
                node = node[part]
    return validate(type(config), data)


def validate(config_class: type[ConfigT], data: Any) -> ConfigT:
    """Build a config from plain data, turning validation errors into one readable ConfigError."""
    try:
        return config_class.model_validate(data)
    except pydantic.ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def describe_validation_error(error: pydantic.ValidationError) -> str:
    """One line per problem: the key, the value given and what was expected."""
    problems = []
    for e in error.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            problems.append(f"unknown config key {key!r} (value {e['input']!r})")
        elif key:
            problems.append(f"{key}={e['input']!r}: {e['msg']}")
        else:
            problems.append(e["msg"].removeprefix("Value error, "))
    return f"invalid {error.title}: " + "; ".join(problems)


def read_yaml(path: str | Path, what: str = "config") -> Any:
    """The data of a YAML file; a missing or malformed file is a :class:`ConfigError` naming
    ``what`` it should have held."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read {what} {path}: {error}") from None


def write_yaml(data: Any, path: str | Path) -> None:
    """Plain data as YAML, keys in their given order."""
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def save_yaml(config: pydantic.BaseModel, path: str | Path) -> None:
    write_yaml(config.model_dump(mode="json"), path)


def load_yaml(config_class: type[ConfigT], path: str | Path) -> ConfigT:
    return validate(config_class, read_yaml(path) or {})
