"""Checkpoints of a run directory: orbax, restored straight into the target layouts.

A checkpoint is one step directory holding two items: ``state`` (any pytree of arrays, e.g. a
``TrainState``; each array written by the devices that hold its shards) and ``meta`` (JSON: the
format version, a :class:`~theseus.checkpoint.meta.CheckpointMeta` — step, data position, config,
policy, mesh — and a fingerprint of every array). Restoring takes a target pytree of
``jax.ShapeDtypeStruct`` with shardings, so each device reads only its own shard from disk: a run
saved under one policy or device count resumes under another, and no array is ever whole on one
device. :meth:`Checkpointer.restore_params` restores the ``params`` entry of the state alone
(generation needs neither the optimizer state nor the data position): Adam's moments are never
read, and every check below applies the same way. A reader first reads a step's metadata
(:meth:`Checkpointer.read_meta`), decides its target by it (the trained parameters alone, the
saved config and policy), then restores: the checkpointer never calls back into its caller. The
orbax plumbing is :mod:`theseus.checkpoint.store`; this module is the policy (checks, fallback,
errors).

Robustness: orbax writes a step into a temporary directory and renames it on commit, so an
interrupted save leaves no step behind (temporary directories are ignored and removed when a
:class:`Checkpointer` opens the directory). A committed step that was damaged afterwards (a file
deleted or truncated, garbage metadata, flipped bits in the data) fails one of the checks of
:meth:`Checkpointer.restore_state` — orbax's own reads, or the per-array fingerprints, which are exact
integer hashes independent of the layout — and is reported as :class:`CheckpointError` naming the
directory and step. Restoring step ``None`` falls back to the newest good step and says which
ones it skipped. A checkpoint of another model (different tree or shapes) is an
:class:`IncompatibleCheckpointError` naming the first mismatching paths; it never falls back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import jax
import numpy as np

from theseus.accounting.records import as_json
from theseus.checkpoint.budget import HOST_BUDGET_BYTES, limit, read_requests, write_requests
from theseus.checkpoint.checks import compatibility_problems, one_line
from theseus.checkpoint.fingerprints import fingerprints
from theseus.checkpoint.meta import CheckpointMeta, MetadataFile
from theseus.checkpoint.store import OrbaxStore
from theseus.distributed.join import main_process_logger

logger = main_process_logger(__name__)

#: The entry of a state that :meth:`Checkpointer.restore_params` reads.
PARAMS = "params"
_MAX_LISTED = 5
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or cannot be restored into the requested target."""


class CheckpointWriteError(Exception):
    """A checkpoint could not be written; the previously committed ones are intact. A training
    run stops on it, and ``theseus train`` exits with ``exit_code``."""

    exit_code: ClassVar[int] = 5


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint whose tree or shapes differ from the target (another model)."""


@dataclass(frozen=True)
class Restored:
    """A restored state (or its parameters alone) in the target's layouts, and its metadata."""

    state: Any
    meta: CheckpointMeta

    @property
    def step(self) -> int:
        return self.meta.step


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A step that a restore of step ``None`` passed over, and why."""

    step: int
    reason: str


# --- the checkpointer ------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores the checkpoints (pytrees of arrays) of one run directory.

    Must be created and called by every process of a multi-process run (saving and restoring are
    collective). Saves are asynchronous: :meth:`save` returns once the arrays are copied off the
    devices, and the files are written in the background; :meth:`wait` blocks until they are
    committed. The last ``keep`` steps are kept.

    ``read_only`` opens a directory another job may be writing (e.g. to evaluate a running
    training job): nothing is created, removed or saved, and its temporary directories are left
    alone. Warnings (fallbacks, removals) go to this module's logger, on the main process.

    ``host_budget_bytes`` bounds the array data a save or restore stages in host memory at once
    (per process; at least one shard: see :mod:`theseus.checkpoint.budget`), so saving or
    restoring a state never holds a second copy of it on the host.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
        host_budget_bytes: int = HOST_BUDGET_BYTES,
    ):
        if keep < 1:
            raise ValueError(f"keep={keep}: a checkpointer keeps at least one step")
        if host_budget_bytes < 1:
            raise ValueError(f"host_budget_bytes={host_budget_bytes}: give a positive byte count")
        self.host_budget_bytes = host_budget_bytes
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.read_only = read_only
        self._bad_steps: set[int] = set()
        self._metadata: dict[int, MetadataFile] = {}  # by step, since the last read_meta
        self._saving: int | None = None  # the step whose save may still be running
        self.skipped: tuple[SkippedCheckpoint, ...] = ()
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"no checkpoints in {self.directory}: it is not a directory")
        try:
            self._store = OrbaxStore(
                self.directory,
                keep=None if read_only else keep,
                async_save=async_save,
                read_only=read_only,
            )
        except Exception as error:  # any failure to open is reported the same way
            raise CheckpointError(
                f"cannot open checkpoint directory {self.directory}: {one_line(error)}"
            ) from error

    # --- queries -------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (uncommitted temporary directories are not steps)."""
        return self._store.all_steps()

    def latest_step(self) -> int | None:
        """The newest committed step (not checked for damage; a restore checks)."""
        return self._store.latest_step()

    def step_directory(self, step: int) -> Path:
        return self.directory / str(step)

    # --- saving ---------------------------------------------------------------------------------

    def save(self, state: Any, meta: CheckpointMeta) -> None:
        """Start saving ``state`` and its ``meta`` as step ``meta.step``.

        Returns once the arrays are copied to host memory, so the caller may donate ``state`` to
        the next train step at once. Older steps beyond ``keep`` are removed after the commit.
        """
        step = meta.step
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only; cannot save step {step}")
        try:
            json.dumps(as_json(meta), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"checkpoint metadata must be plain JSON: {error}") from None
        self.wait()  # a failure of the previous save is reported as that step's
        self._clear_way_for(step)
        payload = as_json(MetadataFile(meta, fingerprints(state)))
        in_flight = limit(self.host_budget_bytes, write_requests(state))
        try:
            started = self._store.save(step, state, payload, in_flight_bytes=in_flight)
        except Exception as error:  # OSError, or orbax's wrapping of it
            raise self._save_error(step, error) from error
        self._saving = step
        if not started:
            raise CheckpointError(
                f"orbax declined to save step {step} in {self.directory} (steps there: "
                f"{self.all_steps()})"
            )

    def _clear_way_for(self, step: int) -> None:
        """Remove damaged steps at or after ``step``; refuse to write under good later ones."""
        later = [s for s in self.all_steps() if s >= step]
        blocking = [s for s in later if s not in self._bad_steps]
        if blocking:
            raise CheckpointError(
                f"{self.directory} already holds step(s) {blocking} at or after step {step}; "
                "they belong to a later point of this run or to another run. Resume from the "
                "latest step, or save into another directory."
            )
        for bad in later:
            logger.warning(f"removing damaged checkpoint {self.step_directory(bad)} (step {bad})")
            self._store.delete(bad)
            self._bad_steps.discard(bad)
            self._metadata.pop(bad, None)

    def wait(self) -> None:
        """Block until every pending save is committed; a failed one raises
        :class:`CheckpointWriteError`."""
        step, self._saving = self._saving, None
        try:
            self._store.wait()
        except Exception as error:  # the background save's error, any type
            raise self._save_error(step, error) from error

    def _save_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
        """Why a save failed, and what is left: orbax commits a step by renaming its temporary
        directory, so a failed save leaves no step behind and removes none."""
        committed: list[int] | str
        try:
            committed = self.all_steps()
        except Exception:  # noqa: BLE001 - e.g. the directory itself was removed
            committed = "unreadable"
        return CheckpointWriteError(
            f"cannot save checkpoint step {step} in {self.directory}: {one_line(error)}. The "
            f"run stopped; committed steps there ({committed or 'none'}) are unchanged. Free "
            "space or fix the directory's permissions, then continue with --resume."
        )

    def close(self) -> None:
        """Wait for pending saves and release the manager's threads."""
        self._store.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- restoring ------------------------------------------------------------------------------

    def read_meta(self, step: int | None = None) -> CheckpointMeta:
        """The metadata of ``step``, or with ``None`` of the newest committed step whose metadata
        reads: what a caller decides its restore target by (whether a checkpoint holds the
        trained parameters alone, which config and policy saved it) before :meth:`restore_state`
        or :meth:`restore_params` reads any array. The arrays are not checked here; a restore
        checks them, and falls back past a step whose arrays are damaged.

        Raises :class:`CheckpointError` when the step is missing or its metadata is damaged
        (with ``None``: when there is no step, or no step's metadata reads).
        """
        self.wait()
        self._metadata = {}  # read afresh for each decision; the restore after it reuses them
        if step is not None:
            return self._agreed(int(step), self._read_metadata).meta
        reasons = []
        for candidate in self._newest_first():
            try:
                return self._agreed(candidate, self._read_metadata).meta
            except CheckpointError as error:
                reasons.append(str(error))
        raise self._no_good_step(reasons)

    def restore_state(self, step: int | None, target: Any) -> Restored:
        """Restore ``step`` (or, with ``None``, the newest good step) into ``target``'s layouts.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (for a training run,
        ``theseus.training.run.checkpointing.restore_target`` of the step's :meth:`read_meta`);
        each device reads its own shards. With ``None``, a damaged step falls back to the one
        before it, restored into the same target (the steps of one run hold one tree); steps
        passed over are logged and kept in :attr:`skipped`, and :attr:`Restored.meta` is the
        metadata of the step restored.

        Raises :class:`CheckpointError` when the step is missing or damaged (with ``None``: when
        no step is good) and :class:`IncompatibleCheckpointError` when the checkpoint holds
        another tree or other shapes than ``target``.
        """
        return self._restore(step, target, entry=None)

    def restore_params(self, step: int | None, target: Any) -> Restored:
        """:meth:`restore_state` of the state's ``params`` entry alone: ``target`` describes the
        parameters, and only they are read and checked (the optimizer state never is)."""
        return self._restore(step, target, entry=PARAMS)

    def restore_entry(self, step: int, target: Any, entry: str) -> Restored:
        """:meth:`restore_state` of the state's ``entry`` alone, of ``step``: ``target``
        describes that entry, and only it is read and checked."""
        return self._restore(step, target, entry=entry)

    def _restore(self, step: int | None, target: Any, *, entry: str | None) -> Restored:
        """Restore ``state[entry]`` (``None``: the whole state) of ``step``, or of the newest
        good step with ``None``."""
        self.skipped = ()
        self.wait()

        def read(candidate: int) -> Restored:
            return self._read_step(candidate, target, entry)

        if step is not None:
            return self._agreed(int(step), read)
        skipped = []
        for candidate in self._newest_first():
            try:
                restored = self._agreed(candidate, read)
            except IncompatibleCheckpointError:
                raise
            except CheckpointError as error:
                skipped.append(SkippedCheckpoint(candidate, str(error)))
                continue
            self.skipped = tuple(skipped)
            if skipped:
                logger.warning(
                    f"restored step {candidate} from {self.directory}; skipped damaged "
                    + "; ".join(f"step {s.step} ({s.reason})" for s in skipped)
                )
            return restored
        self.skipped = tuple(skipped)
        raise self._no_good_step([s.reason for s in skipped])

    def _newest_first(self) -> list[int]:
        """The committed steps, newest first; an error when there is none."""
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.directory}")
        return steps[::-1]

    def _no_good_step(self, reasons: list[str]) -> CheckpointError:
        return CheckpointError(
            f"no good checkpoint in {self.directory}; every step is damaged:\n"
            + "\n".join(f"  {reason}" for reason in reasons)
        )

    def _agreed(self, step: int, read: Callable[[int], T]) -> T:
        """``read(step)`` on every process, with one verdict: a step unreadable on any process
        is damaged on all of them."""
        result: T | None = None
        error: CheckpointError | None = None
        try:
            result = read(step)
        except CheckpointError as caught:
            error = caught
        failing = _failing_processes(error is not None)
        if error is None and failing:
            error = CheckpointError(
                f"{self._where(step)} is damaged: unreadable on process(es) {failing}"
            )
        if error is not None:
            if not isinstance(error, IncompatibleCheckpointError):
                self._bad_steps.add(step)  # a later save at or before this step replaces it
            raise error
        assert result is not None  # read without an error
        return result

    def _where(self, step: int) -> str:
        return f"checkpoint {self.step_directory(step)} (step {step})"

    def _read_metadata(self, step: int) -> MetadataFile:
        """The metadata file of committed ``step``, checked to name it (parsed once between two
        :meth:`read_meta` calls: the restore that follows one reads the metadata it read)."""
        if step in self._metadata:
            return self._metadata[step]
        where = self._where(step)
        if step not in self.all_steps():
            raise CheckpointError(
                f"{where} does not exist; committed steps in {self.directory}: "
                f"{self.all_steps() or 'none'}"
            )
        try:
            saved = MetadataFile.from_json(self._store.read_meta(step))
        except Exception as error:  # orbax and JSON parsing raise many types
            raise CheckpointError(f"{where} is damaged: {one_line(error)}") from error
        if saved.meta.step != step:
            raise CheckpointError(f"{where} is damaged: its metadata says step {saved.meta.step}")
        self._metadata[step] = saved
        return saved

    def _read_step(self, step: int, target: Any, entry: str | None) -> Restored:
        """Read and check one step into ``target`` (``entry``: the state's entry alone)."""
        saved = self._read_metadata(step)
        meta, expected = saved.meta, saved.fingerprints
        where = self._where(step)
        try:
            saved_tree = self._store.saved_tree(step)
        except Exception as error:  # orbax and tensorstore raise many types
            raise CheckpointError(f"{where} is damaged: {one_line(error)}") from error
        if entry is not None:  # the one entry, under its name: paths as in the whole state
            saved_tree = {entry: saved_tree.get(entry) if isinstance(saved_tree, dict) else None}
            expected = {p: v for p, v in expected.items() if p.startswith(f"{entry}/")}
        full_target = target if entry is None else {entry: target}
        _check_compatible(saved_tree, full_target, where)
        in_flight = limit(self.host_budget_bytes, read_requests(saved_tree, full_target))
        try:
            if entry is None:
                state = self._store.read_state(step, target, in_flight_bytes=in_flight)
                got = fingerprints(state)
            else:
                state = self._store.read_entry(step, entry, target, in_flight_bytes=in_flight)
                got = fingerprints({entry: state})
        except Exception as error:
            raise CheckpointError(f"{where} is damaged: {one_line(error)}") from error
        wrong = [path for path, value in expected.items() if got.get(path) != value]
        wrong += [path for path in got if path not in expected]
        if wrong:
            raise CheckpointError(
                f"{where} is damaged: the data of {len(wrong)} array(s) differ from what was "
                f"saved (fingerprint mismatch): {', '.join(wrong[:_MAX_LISTED])}"
                + (" ..." if len(wrong) > _MAX_LISTED else "")
            )
        self._bad_steps.discard(step)
        return Restored(state, meta)


def _check_compatible(saved_tree: Any, target: Any, where: str) -> None:
    problems = compatibility_problems(saved_tree, target)
    if problems:
        more = len(problems) - _MAX_LISTED
        raise IncompatibleCheckpointError(
            f"{where} does not fit the target state ({len(problems)} mismatching "
            "path(s)); it was saved from another model or optimizer:\n"
            + "\n".join(f"  {p}" for p in problems[:_MAX_LISTED])
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def _failing_processes(failed_here: bool) -> list[int]:
    """Indices of the processes whose read of a step failed (all processes must call this)."""
    if jax.process_count() == 1:
        return [0] if failed_here else []
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([failed_here], dtype=np.int32))
    return [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]
