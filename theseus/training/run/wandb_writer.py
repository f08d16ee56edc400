"""Weights & Biases tracking of a run (``logging.wandb.project``), through the optional wandb
package: ``pip install 'theseus[wandb]'``. Only the main process logs.

The W&B run's id is kept in the run directory (``wandb-run.json``), so that ``--resume``
continues the same W&B run. A resumed segment logs every row from its first step on: the steps
after the checkpoint it resumes from are trained again, and an earlier segment ended by SIGKILL may
have lost the rows W&B still buffered (seen: an offline file with its header alone). Online, W&B
keeps a run's steps increasing and drops a step it already holds. When W&B fails during a run
(:mod:`~theseus.training.run.dashboards`) and never comes back, the first step it missed is kept
there too (``missed_from``), and the next ``--resume`` logs the rows it missed from
``metrics.jsonl`` before the steps it trains.
W&B's own files go to ``OUT/wandb`` (an offline run stays there until ``wandb sync``).
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import string
from pathlib import Path
from typing import Any

from theseus.config import WandbConfig
from theseus.distributed.join import is_main_process
from theseus.training.trainer import TrainerConfig

WANDB_DIR = "wandb"
RUN_ID_FILE = "wandb-run.json"


def require_wandb(config: WandbConfig) -> None:
    """Stop before anything is written when W&B is asked for but wandb is not installed, or
    (online, on the main process) has no credentials and no terminal to ask for them: W&B would
    otherwise fail only after the run's records are written and its step compiled."""
    if config.project is None:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"logging.wandb.project={config.project!r} asks for a Weights & Biases run, but the "
            "wandb package is not installed; install it with `pip install 'theseus[wandb]'` "
            "(or `pip install wandb`), or leave logging.wandb.project unset"
        )
    if config.mode != "online" or not is_main_process():
        return
    import wandb

    try:  # the credentials wandb.init would look for (environment, .netrc, a prompt)
        wandb.login(verify=False)
    except wandb.errors.UsageError as error:
        raise ValueError(
            f"logging.wandb.project={config.project!r} asks for an online Weights & Biases run, "
            f"but W&B has no credentials here ({error}); run `wandb login` or set WANDB_API_KEY, "
            "or log offline with logging.wandb.mode=offline and upload later with `wandb sync`"
        ) from None


def wandb_row(row: dict[str, Any]) -> dict[str, Any]:
    """A ``metrics.jsonl`` row as W&B metrics: every value but the step, a dict of them (such as
    ``val_loss_by_source``) as ``KEY/NAME``, as TensorBoard names them."""
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat |= {f"{key}/{name}": item for name, item in value.items()}
        elif key != "step":
            flat[key] = value
    return flat


def new_run_id() -> str:
    """A W&B run id: 8 lower-case letters and digits, as W&B makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbWriter:
    """Logs every recorded row at its step to one W&B run whose config is the run's resolved
    config and its ``run.json`` (under ``run``)."""

    def __init__(
        self,
        out_dir: Path,
        config: WandbConfig,
        *,
        run_id: str,
        run_config: dict[str, Any],
    ):
        import wandb

        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name,
            group=config.group,
            tags=config.tags,
            mode=config.mode,
            id=run_id,
            resume="allow",
            dir=str(out_dir),
            config=run_config,
            # The terminal stays the user's: W&B does not wrap stdout and stderr.
            settings=wandb.Settings(console="off"),
        )

    def write(self, row: dict[str, Any]) -> None:
        self.run.log(wandb_row(row), step=row["step"])

    def __enter__(self) -> WandbWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Finish the W&B run and end W&B's service with it: a service that died during the run
        would otherwise fail W&B's own exit hook, a traceback after the run's last line."""
        import wandb

        try:
            self.run.finish(exit_code=0 if exc_info[0] is None else 1)
        finally:
            try:
                wandb.teardown()
            except SystemExit as ended:  # W&B exits when its service ended with an error
                raise RuntimeError(f"W&B's service ended with status {ended.code}") from None


def open_wandb(config: TrainerConfig, out_dir: Path, *, resume: bool) -> WandbWriter | None:
    """The W&B writer of a run whose ``run.json`` is written (``config`` is the trainer's), on
    the main process when ``logging.wandb.project`` is set; else None.

    A resumed run continues the W&B run whose id ``out_dir`` keeps; any other run starts a W&B
    run and keeps its id.
    """
    if config.logging.wandb.project is None or not is_main_process():
        return None
    id_file = out_dir / RUN_ID_FILE
    if resume and id_file.is_file():
        run_id = json.loads(id_file.read_text())["id"]
    else:
        run_id = new_run_id()
        id_file.write_text(json.dumps({"id": run_id}) + "\n")
    return WandbWriter(
        out_dir,
        config.logging.wandb,
        run_id=run_id,
        run_config={
            **config.model_dump(mode="json"),
            "run": json.loads((out_dir / "run.json").read_text()),
        },
    )
