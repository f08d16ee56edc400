"""What a checkpoint records besides its arrays.

:class:`CheckpointMeta` is the one description of a saved step: enough to resume it (step, data
position, the job's config) and to audit it (the policy, mesh and batch accounting it was saved
under, as ``BaseTrainer.execution_facts()`` gives them). It is written and read as JSON by
:func:`~theseus.accounting.records.as_json` and :meth:`CheckpointMeta.from_json` alone, as the
``meta`` entry of a checkpoint's metadata file (:class:`MetadataFile`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from theseus.config import check_int

#: The layout of a checkpoint's metadata file. Version 1: ``{"format_version": 1, "meta": {...},
#: "fingerprints": {path: uint32}}``, ``meta`` holding exactly the fields of CheckpointMeta.
FORMAT_VERSION = 1

_COUNTS = (
    "step",
    "data_position",
    "num_devices",
    "num_processes",
    "replicas",
    "per_device_batch_size",
    "accumulation_steps",
    "global_batch_size",
    "seq_len",
)
_OBJECTS = ("config", "policy", "mesh_shape")


@dataclass(frozen=True)
class CheckpointMeta:
    """One saved step: where the run stands and how it ran.

    ``data_position`` is the index of the next training example to draw (the loop's position
    after step ``step``); ``config`` is the job's config in JSON form; ``policy`` the sharding
    policy in JSON form; the other fields are the run's execution facts (mesh, device and process
    counts, batch accounting).
    """

    step: int
    data_position: int
    config: dict[str, Any]
    policy: dict[str, Any]
    mesh_shape: dict[str, int]
    num_devices: int
    num_processes: int
    replicas: int
    per_device_batch_size: int
    accumulation_steps: int
    global_batch_size: int
    seq_len: int
    # The frozen parameters the saved (trained) ones apply to, when the checkpoint holds the
    # trained parameters alone (fine-tuning): {"run_dir": the run they come from, or None when
    # they are the seed's initialisation; "step"; "seed"; "fingerprints": {path: uint32}}.
    # None: the checkpoint holds every parameter. Older checkpoints have no such key.
    base: dict[str, Any] | None = None
    # The registered training job that wrote the checkpoint (theseus.jobs), e.g.
    # "llama/train/pretrain"; None when its trainer class has none. Checkpoints of releases
    # before it was recorded lack the key: their job follows theseus.jobs.legacy_job.
    job: str | None = None

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            try:
                check_int(f"checkpoint metadata {name}", value, minimum=0)
            except TypeError as error:  # a malformed file: one kind of error for its reader
                raise ValueError(str(error)) from None
        for name in _OBJECTS:
            value = getattr(self, name)
            if not isinstance(value, dict):
                raise ValueError(
                    f"checkpoint metadata {name} must be a JSON object, not {type(value).__name__}"
                )
        if self.job is not None and not isinstance(self.job, str):
            raise ValueError(f"checkpoint metadata job must be a string or null, not {self.job!r}")
        if self.base is not None and not isinstance(self.base, dict):
            raise ValueError(
                f"checkpoint metadata base must be a JSON object or null, not {self.base!r}"
            )

    @classmethod
    def from_json(cls, data: Any) -> CheckpointMeta:
        """Read what :func:`~theseus.accounting.records.as_json` wrote; ``ValueError`` names missing or unknown keys."""
        if not isinstance(data, dict):
            raise ValueError(f"checkpoint metadata is a {type(data).__name__}, not a JSON object")
        fields = dataclasses.fields(cls)
        names = {field.name for field in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        missing, unknown = sorted(required - data.keys()), sorted(data.keys() - names)
        if missing or unknown:
            raise ValueError(
                f"checkpoint metadata does not describe a training step (missing keys: "
                f"{missing or 'none'}; unknown keys: {unknown or 'none'})"
            )
        return cls(**data)


@dataclass(frozen=True)
class MetadataFile:
    """A checkpoint's metadata item: its :class:`CheckpointMeta` and the fingerprint of every
    array of the state (``theseus.checkpoint.fingerprints``), keyed by state path."""

    meta: CheckpointMeta
    fingerprints: dict[str, int]

    json_properties: ClassVar[dict[str, str]] = {"format_version": "format_version"}
    format_version: ClassVar[int] = FORMAT_VERSION

    @classmethod
    def from_json(cls, data: Any) -> MetadataFile:
        """Read what :func:`~theseus.accounting.records.as_json` wrote; ``ValueError`` says what is wrong with it."""
        if not isinstance(data, dict):
            raise ValueError(f"metadata is a {type(data).__name__}, not a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"metadata format_version is {version!r}, expected {FORMAT_VERSION}")
        prints = data.get("fingerprints")
        if not isinstance(prints, dict):
            raise ValueError("metadata lacks 'fingerprints'")
        if not all(isinstance(v, int) and 0 <= v < 2**32 for v in prints.values()):
            raise ValueError("metadata fingerprints are not 32-bit unsigned integers")
        return cls(CheckpointMeta.from_json(data.get("meta")), prints)
