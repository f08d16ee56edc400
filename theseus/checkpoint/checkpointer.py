"""Checkpoints of a run directory: orbax, restored straight into the target layouts.

A checkpoint is one step directory holding two items: ``state`` (any pytree of arrays, e.g. a
``TrainState``; each array written by the devices that hold its shards) and ``meta`` (JSON: the
format version, a :class:`~theseus.checkpoint.meta.CheckpointMeta` — step, data position, config,
policy, mesh — and a fingerprint of every array). Restoring takes a target pytree of
``jax.ShapeDtypeStruct`` with shardings, so each device reads only its own shard from disk: a run
saved under one policy or device count resumes under another, and no array is ever whole on one
device. ``params_only`` restores the ``params`` entry of the state alone (generation needs neither
the optimizer state nor the data position): Adam's moments are never read, and every check below
applies the same way.

Robustness: orbax writes a step into a temporary directory and renames it on commit, so an
interrupted save leaves no step behind (temporary directories are ignored and removed when a
:class:`Checkpointer` opens the directory). A committed step that was damaged afterwards (a file
deleted or truncated, garbage metadata, flipped bits in the data) fails one of the checks of
:meth:`Checkpointer.restore` — orbax's own reads, or the per-array fingerprints, which are exact
integer hashes independent of the layout — and is reported as :class:`CheckpointError` naming the
directory and step. ``restore(None, ...)`` then falls back to the newest good step and says which
ones it skipped. A checkpoint of another model (different tree or shapes) is an
:class:`IncompatibleCheckpointError` naming the first mismatching paths; it never falls back.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from theseus.checkpoint.budget import HOST_BUDGET_BYTES, limit, read_requests, write_requests
from theseus.checkpoint.checks import compatibility_problems, one_line
from theseus.checkpoint.fingerprints import fingerprints
from theseus.checkpoint.meta import CheckpointMeta, MetadataFile

logger = logging.getLogger(__name__)

_STATE = "state"
_META = "meta"
#: The entry of a state that ``restore(..., params_only=True)`` reads.
PARAMS = "params"
_MAX_LISTED = 5


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or cannot be restored into the requested target."""


class CheckpointWriteError(Exception):
    """A checkpoint could not be written; the previously committed ones are intact. (A training
    run stops with exit status 5 on it: :class:`theseus.training.run.stops.CheckpointWriteError`.)"""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint whose tree or shapes differ from the target (another model)."""


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` returns: the state (with ``params_only``, the
    parameters alone) in the target's layouts, and the metadata saved with it."""

    state: Any
    meta: CheckpointMeta

    @property
    def step(self) -> int:
        return self.meta.step


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A step that ``restore(None, ...)`` passed over, and why."""

    step: int
    reason: str


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def _quiet_orbax_warnings() -> Iterator[None]:
    """Keep orbax's absl warnings about options it adjusts (a read-only manager "setting
    save_interval_steps=0", "Given directory is read only") off the user's terminal: they
    describe what this class asked for, not a problem."""
    absl = logging.getLogger("absl")
    quiet = _BelowError()
    absl.addFilter(quiet)
    try:
        yield
    finally:
        absl.removeFilter(quiet)


# --- the checkpointer ------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores the checkpoints (pytrees of arrays) of one run directory.

    Must be created and called by every process of a multi-process run (saving and restoring are
    collective). Saves are asynchronous: :meth:`save` returns once the arrays are copied off the
    devices, and the files are written in the background; :meth:`wait` blocks until they are
    committed. The last ``keep`` steps are kept.

    ``read_only`` opens a directory another job may be writing (e.g. to evaluate a running
    training job): nothing is created, removed or saved, and its temporary directories are left
    alone. ``log`` receives the warnings (fallbacks, removals); the default is this module's
    logger.

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
        log: Callable[[str], None] | None = None,
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
        self._log = log if log is not None else logger.warning
        self._bad_steps: set[int] = set()
        self._saving: int | None = None  # the step whose save may still be running
        self.skipped: tuple[SkippedCheckpoint, ...] = ()
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"no checkpoints in {self.directory}: it is not a directory")
        with _quiet_orbax_warnings():
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep,
                enable_async_checkpointing=async_save,
                create=not read_only,
                # Temporary directories are saves that never committed (e.g. a killed process). A
                # reader leaves them alone: they may be a running job's saves in progress.
                cleanup_tmp_directories=not read_only,
                read_only=read_only,
                # Do not read every step's metadata on open: a damaged step must not stop the open.
                lightweight_initialize=True,
            )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        state_handler = ocp.handlers.StandardCheckpointHandler()
        meta_handler = ocp.handlers.JsonCheckpointHandler()
        registry.add(_STATE, ocp.args.StandardSave, state_handler)
        registry.add(_STATE, ocp.args.StandardRestore, state_handler)
        # The params-only restore: orbax's partial restore reads one entry of the state item.
        params_handler = ocp.handlers.PyTreeCheckpointHandler()
        registry.add(_STATE, ocp.args.PyTreeRestore, params_handler)
        self._state_handlers = (state_handler, params_handler)
        registry.add(_META, ocp.args.JsonSave, meta_handler)
        registry.add(_META, ocp.args.JsonRestore, meta_handler)
        try:
            with _quiet_orbax_warnings():
                self._manager = ocp.CheckpointManager(
                    self.directory, options=options, handler_registry=registry
                )
        except Exception as error:  # any failure to open is reported the same way
            raise CheckpointError(
                f"cannot open checkpoint directory {self.directory}: {one_line(error)}"
            ) from error

    # --- queries -------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (uncommitted temporary directories are not steps)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step (not checked for damage; :meth:`restore` checks)."""
        return self._manager.latest_step()

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
            json.dumps(meta.to_json(), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"checkpoint metadata must be plain JSON: {error}") from None
        self.wait()  # a failure of the previous save is reported as that step's
        self._clear_way_for(step)
        payload = MetadataFile(meta, fingerprints(state)).to_json()
        self._set_in_flight_limit(save=limit(self.host_budget_bytes, write_requests(state)))
        try:
            started = self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(payload)}
                ),
            )
        except Exception as error:  # OSError, or orbax's wrapping of it
            raise self._save_error(step, error) from error
        self._saving = step
        if not started:
            raise CheckpointError(
                f"orbax declined to save step {step} in {self.directory} (steps there: "
                f"{self.all_steps()})"
            )

    def _set_in_flight_limit(self, *, save: int | None = None, restore: int | None = None) -> None:
        """Set orbax's in-flight byte limit of the next save or restore of the state item.

        Orbax takes these limits only when a handler is built, and the manager's handlers are
        built once; the limiter itself is made afresh from them at the start of every call, so
        setting them just before a call bounds that call alone (a save's limiter is taken before
        :meth:`save` returns, so a background write keeps its own).
        """
        for handler in self._state_handlers:
            # StandardCheckpointHandler wraps a PyTreeCheckpointHandler, which wraps the base
            # handler that serializes; each keeps its own copy of the limits.
            inner = getattr(handler, "_impl", handler)
            for part in (inner, inner._handler_impl):
                assert hasattr(part, "_save_concurrent_bytes"), f"orbax changed: {type(part)}"
                if save is not None:
                    part._save_concurrent_bytes = save
                if restore is not None:
                    part._restore_concurrent_bytes = restore

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
            self._log(f"removing damaged checkpoint {self.step_directory(bad)} (step {bad})")
            self._manager.delete(bad)
            self._bad_steps.discard(bad)

    def wait(self) -> None:
        """Block until every pending save is committed; a failed one raises
        :class:`CheckpointWriteError`."""
        step, self._saving = self._saving, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # the background save's error, any type
            raise self._save_error(step, error) from error

    def _save_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
        """Why a save failed, and what is left: orbax commits a step by renaming its temporary
        directory, so a failed save leaves no step behind and removes none."""
        try:
            committed = self.all_steps()
        except Exception:  # noqa: BLE001 - e.g. the directory itself was removed
            committed = "unreadable"
        return CheckpointWriteError(
            f"cannot save checkpoint step {step} in {self.directory}: {one_line(error)}. The "
            f"run stopped; committed steps there ({committed or 'none'}) are unchanged. Free "
            "space or fix the directory's permissions, then continue with --resume."
        )

    def reached_preemption(self, step: int) -> bool:
        """Whether all processes agreed to stop and save at ``step`` after a preemption notice
        (JAX's preemption sync point, through orbax; always False without jax.distributed)."""
        return self._manager.reached_preemption(step)

    def close(self) -> None:
        """Wait for pending saves and release the manager's threads."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- restoring ------------------------------------------------------------------------------

    def restore(
        self,
        step: int | None,
        target: Any | Callable[[CheckpointMeta], Any],
        *,
        params_only: bool = False,
    ) -> Restored:
        """Restore ``step`` (or, with ``None``, the newest good step) into ``target``'s layouts.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (for a training run,
        ``theseus.training.run.checkpointing.restore_target``), or a function that builds one
        from the step's metadata (generation lays the parameters out by the saved config and
        policy); each device reads its own shards. With ``params_only``, ``target`` describes
        the state's ``params`` entry, and only that entry is read and checked. Steps that
        ``None`` passed over are logged and kept in :attr:`skipped`.

        Raises :class:`CheckpointError` when the step is missing or damaged (with ``None``: when
        no step is good) and :class:`IncompatibleCheckpointError` when the checkpoint holds
        another tree or other shapes than ``target``.
        """
        self.skipped = ()
        self.wait()
        if step is not None:
            return self._restore_step(int(step), target, params_only)
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.directory}")
        skipped = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(candidate, target, params_only)
            except IncompatibleCheckpointError:
                raise
            except CheckpointError as error:
                skipped.append(SkippedCheckpoint(candidate, str(error)))
                continue
            self.skipped = tuple(skipped)
            if skipped:
                self._log(
                    f"restored step {candidate} from {self.directory}; skipped damaged "
                    + "; ".join(f"step {s.step} ({s.reason})" for s in skipped)
                )
            return restored
        self.skipped = tuple(skipped)
        raise CheckpointError(
            f"no good checkpoint in {self.directory}; every step is damaged:\n"
            + "\n".join(f"  {s.reason}" for s in skipped)
        )

    def _restore_step(self, step: int, target: Any, params_only: bool) -> Restored:
        """Read and check one step; every process reaches the same verdict."""
        where = f"checkpoint {self.step_directory(step)} (step {step})"
        try:
            restored, error = self._read_step(step, target, params_only, where), None
        except CheckpointError as caught:
            restored, error = None, caught
        failing = _failing_processes(error is not None)
        if error is None and failing:
            error = CheckpointError(f"{where} is damaged: unreadable on process(es) {failing}")
        if error is not None:
            if not isinstance(error, IncompatibleCheckpointError):
                self._bad_steps.add(step)  # a later save at or before this step replaces it
            raise error
        self._bad_steps.discard(step)
        return restored

    def _read_step(self, step: int, target: Any, params_only: bool, where: str) -> Restored:
        if step not in self._manager.all_steps():
            raise CheckpointError(
                f"{where} does not exist; committed steps in {self.directory}: "
                f"{self.all_steps() or 'none'}"
            )
        try:
            payload = self._manager.restore(
                step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
            )[_META]
            saved = MetadataFile.from_json(payload)
            meta, expected = saved.meta, saved.fingerprints
            saved_tree = self._manager.item_metadata(step)[_STATE]
            if saved_tree is None:
                raise ValueError("the state's metadata is missing")
            saved_tree = getattr(saved_tree, "tree", saved_tree)
        except Exception as error:  # orbax and tensorstore raise many types
            raise CheckpointError(f"{where} is damaged: {one_line(error)}") from error
        if meta.step != step:
            raise CheckpointError(f"{where} is damaged: its metadata says step {meta.step}")
        target = target(meta) if callable(target) else target
        if params_only:
            saved_tree = {PARAMS: saved_tree.get(PARAMS) if isinstance(saved_tree, dict) else None}
            expected = {p: v for p, v in expected.items() if p.startswith(f"{PARAMS}/")}
        full_target = {PARAMS: target} if params_only else target
        _check_compatible(saved_tree, full_target, where)
        requests = read_requests(saved_tree, full_target)
        self._set_in_flight_limit(restore=limit(self.host_budget_bytes, requests))
        try:
            state = self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: _restore_args(target, params_only)})
            )[_STATE]
            state = state[PARAMS] if params_only else state
            got = fingerprints({PARAMS: state} if params_only else state)
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
        return Restored(state, meta)


def _restore_args(target: Any, params_only: bool) -> Any:
    """Orbax's arguments for reading the state item into ``target``: the whole state, or only
    its ``params`` entry (a partial restore: the other entries are never read)."""
    if not params_only:
        return ocp.args.StandardRestore(target)
    item = {PARAMS: target}
    return ocp.args.PyTreeRestore(
        item=item,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True,
    )


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
