"""TensorBoard event files of a run (``logging.tensorboard=true``), through tensorboardX's
summaries, an optional dependency: ``pip install 'theseus[tensorboard]'``. Only the main process
writes.

Each row's events are written by the caller, in one write: tensorboardX's ``SummaryWriter``
writes from a thread of its own, where a full disk ends the thread with a traceback and, ten
events later, blocks the run forever on its queue (seen). Here a failed write raises in
:meth:`TensorBoardWriter.write`, where :class:`~theseus.training.run.dashboards.GuardedDashboard`
says it once and retries the row later, and the file is cut back to its last whole record
(TensorBoard stops reading a file at a broken one). Written rows are in the kernel's hands at
once, so a killed run keeps them (tensorboardX held up to 30 s of them).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import yaml

TENSORBOARD_DIR = "tensorboard"
MISSED_FILE = "missed.json"  # the first step TensorBoard missed, for --resume (dashboards.py)


class TensorBoardWriter:
    """Every numeric metric of a ``metrics.jsonl`` row as a scalar under its own name, at its
    step (a dict of them, such as ``val_loss_by_source``, as ``KEY/NAME``); the resolved config
    as text at step 0. One event file per run segment, as TensorBoard names them."""

    def __init__(self, out_dir: Path, config: dict[str, Any]):
        try:
            from tensorboardX import summary
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.record_writer import masked_crc32c
        except ModuleNotFoundError:
            raise ValueError(
                "logging.tensorboard=true needs the tensorboardX package, which is not "
                "installed; install it with `pip install 'theseus[tensorboard]'` (or "
                "`pip install tensorboardX`), or set logging.tensorboard=false"
            ) from None
        self._summary, self._event, self._crc = summary, Event, masked_crc32c
        folder = out_dir / TENSORBOARD_DIR
        folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self._file = open(folder / name, "ab", buffering=0)  # noqa: SIM115 - closed in __exit__
        self._size = 0  # bytes of whole records in the file
        text = yaml.safe_dump(config, sort_keys=False)
        self._append(
            [
                Event(wall_time=time.time(), file_version="brain.Event:2"),
                self._at(0, summary.text("config", f"```yaml\n{text}```")),
            ]
        )

    def write(self, row: dict[str, Any]) -> None:
        step, scalar = row["step"], self._summary.scalar
        events = []
        for key, value in row.items():
            if isinstance(value, dict):  # e.g. val_loss_by_source: one scalar per source
                events += [self._at(step, scalar(f"{key}/{n}", v)) for n, v in value.items()]
            elif key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                events.append(self._at(step, scalar(key, value)))
        self._append(events)

    def _at(self, step: int, summary: Any) -> Any:
        return self._event(wall_time=time.time(), step=step, summary=summary)

    def _append(self, events: list[Any]) -> None:
        """Write ``events`` as TFRecords (length, its CRC, the event, its CRC) in one write; on a
        failure, cut the file back to its last whole record and raise."""
        data = b"".join(self._record(event.SerializeToString()) for event in events)
        try:
            written = self._file.write(data)
            if written != len(data):  # a short write: the disk filled up during it
                raise OSError(f"wrote {written} of {len(data)} bytes of TensorBoard events")
        except OSError:
            with contextlib.suppress(OSError):  # a file that cannot be cut keeps what it has
                os.ftruncate(self._file.fileno(), self._size)
            raise
        self._size += written

    def _record(self, data: bytes) -> bytes:
        header = struct.pack("<Q", len(data))
        crc = self._crc
        return header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data))

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._file.close()
