"""TensorBoard event files of a run (``logging.tensorboard=true``), written by tensorboardX, an
optional dependency: ``pip install 'theseus[tensorboard]'``. Only the main process writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

TENSORBOARD_DIR = "tensorboard"


class TensorBoardWriter:
    """Every numeric metric of a ``metrics.jsonl`` row as a scalar under its own name, at its
    step (a dict of them, such as ``val_loss_by_source``, as ``KEY/NAME``); the resolved config
    as text at step 0."""

    def __init__(self, out_dir: Path, config: dict[str, Any]):
        try:
            from tensorboardX import SummaryWriter
        except ModuleNotFoundError:
            raise ValueError(
                "logging.tensorboard=true needs the tensorboardX package, which is not "
                "installed; install it with `pip install 'theseus[tensorboard]'` (or "
                "`pip install tensorboardX`), or set logging.tensorboard=false"
            ) from None
        self.writer = SummaryWriter(str(out_dir / TENSORBOARD_DIR), flush_secs=30)
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", f"```yaml\n{text}```", global_step=0)

    def write(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for key, value in row.items():
            if isinstance(value, dict):  # e.g. val_loss_by_source: one scalar per source
                for name, item in value.items():
                    self.writer.add_scalar(f"{key}/{name}", item, global_step=step)
            elif key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.writer.close()
