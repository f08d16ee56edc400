"""What a Weights & Biases offline run holds, read back from its ``.wandb`` file (wandb ships no
Python reader for it).

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each a 7-byte header (checksum, length, type: full, first, middle, last) and its
data; a block's tail shorter than a chunk header is padding. The chunks of one record, joined,
are a protobuf ``Record`` of ``wandb.proto.wandb_internal_pb2``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # checksum, length, type
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every ``Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert HEADER.unpack_from(data) == (b":W&B", 0xBEE1, 0), data[: HEADER.size]
    offset, found, parts = HEADER.size, [], []
    while offset + CHUNK.size <= len(data):
        if BLOCK - offset % BLOCK < CHUNK.size:  # the block's padding
            offset += BLOCK - offset % BLOCK
            continue
        _, length, kind = CHUNK.unpack_from(data, offset)
        offset += CHUNK.size
        if offset + length > len(data):  # cut by a killed process
            break
        parts.append(data[offset : offset + length])
        offset += length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            found.append(record)
            parts = []
    return found


@dataclass
class OfflineRun:
    """One offline run: its id, the rows it logged (by step) and its config."""

    run_id: str
    rows: dict[int, dict] = field(default_factory=dict)
    logged_steps: list[int] = field(default_factory=list)  # every history row, repeats kept
    config: dict = field(default_factory=dict)


def read_run(path: Path) -> OfflineRun:
    """The run of one ``.wandb`` file: history rows as ``{step: {key: value}}`` and the config."""
    run = None
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = run or OfflineRun(record.run.run_id)
            run.config |= _items(record.run.config.update)
        elif kind == "config":
            run.config |= _items(record.config.update)
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            step = row.pop("_step")
            run.logged_steps.append(step)
            run.rows[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert run is not None, f"{path} holds no run record"
    return run


def _items(items) -> dict:
    return {item.key: json.loads(item.value_json) for item in items}


def run_files(run_dir: Path) -> list[Path]:
    """The ``.wandb`` files of every W&B run written under ``run_dir``."""
    return sorted(run_dir.rglob("*.wandb"))
