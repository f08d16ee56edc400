"""Progress of a run on the main process: a rich progress bar (step, loss, step time, tokens/s,
MFU when known, ETA) and a metrics line every ``logging.log_interval`` steps. Other processes stay
silent."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from theseus.config import LoggingConfig
from theseus.distributed.join import is_main_process, main_process_logger

logger = main_process_logger(__name__)


class Reporter:
    """Shows steps ``first_done + 1 .. total`` as they are recorded."""

    def __init__(self, first_done: int, total: int, config: LoggingConfig):
        self.total = total
        self.config = config
        self.main = is_main_process()
        self.first_done = first_done
        self.progress: Progress | None = None
        if self.main and config.progress_bar:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=total, completed=first_done, status=""
            )

    def __enter__(self) -> Reporter:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, row: dict) -> None:
        """Show a ``metrics.jsonl`` row (its speed from ``step_time_s``, ``tokens_per_s`` and
        ``mfu``)."""
        step = row["step"]
        status = f"loss {row['loss']:.4f} {speed(row)}"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=status)
        interval = self.config.log_interval
        if step % interval == 0 or "val_loss" in row or step == self.first_done + 1:
            val = f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""
            logger.info(
                f"step {step}/{self.total} loss {row['loss']:.4f}{val} "
                f"lr {row['learning_rate']:.2e} {speed(row)}"
            )


def speed(row: dict) -> str:
    """``123 ms/step 45,678 tokens/s MFU 41.2%`` (MFU only when the row has it)."""
    text = f"{row['step_time_s'] * 1e3:,.0f} ms/step {row['tokens_per_s']:,.0f} tokens/s"
    return text + (f" MFU {row['mfu']:.1%}" if "mfu" in row else "")
