"""What an evaluate job (and a run started with ``--init-from``) takes from the run it reads: the run's own config (``config.yaml``, written
by every training run and by ``theseus import-hf``) as the base under the user's overrides, and a
model section that must stay the run's, refused field by field before anything is restored."""

from __future__ import annotations

from pathlib import Path

from theseus.config import ConfigError, ConfigT, read_yaml, validate

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


def model_changes(given: ConfigT, run: ConfigT, whose: str = "the run's") -> list[str]:
    """Each ``model.*`` field where ``given`` differs from ``run``, with both values."""
    ours, theirs = given.model.model_dump(mode="json"), run.model.model_dump(mode="json")
    return [
        f"model.{name}={ours[name]!r} ({whose}: {theirs[name]!r})"
        for name in ours
        if ours[name] != theirs[name]
    ]


def check_same_model(config: ConfigT, source: str | Path) -> None:
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


def check_base_model(config: ConfigT, base_dir: str | Path) -> None:
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
