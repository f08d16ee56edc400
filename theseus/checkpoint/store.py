"""Orbax plumbing of a checkpoint directory: one manager, two items a step, bounded host staging.

A step holds ``state`` (a pytree of arrays, each written by the devices that hold its shards) and
``meta`` (JSON). :class:`OrbaxStore` opens the directory, saves and reads those items, reads the
``params`` entry of the state alone (orbax's partial restore: the other entries are never read),
and sets orbax's private in-flight byte limits for each call (:mod:`theseus.checkpoint.budget`).
What a step must contain, and what to do when it does not, is the
:class:`~theseus.checkpoint.checkpointer.Checkpointer`'s policy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

_STATE = "state"
_META = "meta"


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def _quiet_orbax_warnings() -> Iterator[None]:
    """Keep orbax's absl warnings about options it adjusts (a read-only manager "setting
    save_interval_steps=0", "Given directory is read only") off the user's terminal: they
    describe what this module asked for, not a problem."""
    absl = logging.getLogger("absl")
    quiet = _BelowError()
    absl.addFilter(quiet)
    try:
        yield
    finally:
        absl.removeFilter(quiet)


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's standard type handlers, the array one without replica-parallel writes when one
    process holds every device.

    Replica-parallel writes split each replicated array among the processes that hold a copy, so
    each writes a share; in one process every share is written by the same process anyway, and
    on CPU and TPU (where orbax turns it on) each share is first sliced on its device by a program
    of its own: 64 compiled slices for a tiny GPT on 8 devices, 5 s of a first save's CPU against
    0.15 s. The checkpoint is the same either way; the array handler keeps orbax's own metadata
    store (``array_metadatas/``)."""
    standard = {
        ty: ocp.type_handlers.get_type_handler(ty) for ty in ocp.type_handlers.supported_types()
    }
    array = standard[jax.Array]
    store = getattr(array, "_array_metadata_store", None)
    assert store is not None, f"orbax changed: {type(array)} has no array metadata store"
    standard[jax.Array] = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=jax.process_count() > 1, array_metadata_store=store
    )
    return ocp.type_handlers.create_type_handler_registry(*standard.items())


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, blind to JAX's preemption sync point: the training loop alone asks for
    it, keyed by its count of steps (theseus/training/run/preemption.py). Orbax's own look, from
    ``save`` and from its background commit, would pass the run's step instead (JAX's protocol
    takes the largest key any process passed), and its commit fails on a resumed run's
    preemption step (it subtracts a naive time from an aware one)."""

    def reached_preemption(self, step: int) -> bool:
        del step
        return False


class OrbaxStore:
    """One directory's orbax ``CheckpointManager``, with the ``state`` and ``meta`` items.

    ``keep`` steps are kept (``None``: all); ``read_only`` creates, removes and cleans nothing.
    Opening raises whatever orbax raises (the caller reports it).
    """

    def __init__(
        self, directory: Path, *, keep: int | None, async_save: bool, read_only: bool
    ) -> None:
        with _quiet_orbax_warnings():
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep,
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
        type_handlers = _type_handlers()
        state_handler = ocp.handlers.StandardCheckpointHandler()
        # The standard handler takes no registry: its PyTree handler and the base handler under
        # it each keep one.
        for part in (state_handler._impl, state_handler._impl._handler_impl):
            assert hasattr(part, "_type_handler_registry"), f"orbax changed: {type(part)}"
            part._type_handler_registry = type_handlers
        meta_handler = ocp.handlers.JsonCheckpointHandler()
        registry.add(_STATE, ocp.args.StandardSave, state_handler)
        registry.add(_STATE, ocp.args.StandardRestore, state_handler)
        # Reading one entry of the state: orbax's partial restore of the state item.
        entry_handler = ocp.handlers.PyTreeCheckpointHandler(type_handler_registry=type_handlers)
        registry.add(_STATE, ocp.args.PyTreeRestore, entry_handler)
        self._state_handlers = (state_handler, entry_handler)
        registry.add(_META, ocp.args.JsonSave, meta_handler)
        registry.add(_META, ocp.args.JsonRestore, meta_handler)
        with _quiet_orbax_warnings():
            self._manager = _Manager(directory, options=options, handler_registry=registry)

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (uncommitted temporary directories are not steps)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, in_flight_bytes: int) -> bool:
        """Start saving ``state`` and ``meta`` as ``step``; False when orbax declines."""
        self._set_in_flight_limit(save=in_flight_bytes)
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)}
            ),
        )

    def read_meta(self, step: int) -> dict:
        return self._manager.restore(
            step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
        )[_META]

    def saved_tree(self, step: int) -> Any:
        """The state's tree as saved: array metadata (shapes, dtypes, chunks), no data."""
        tree = self._manager.item_metadata(step)[_STATE]
        if tree is None:
            raise ValueError("the state's metadata is missing")
        return getattr(tree, "tree", tree)

    def read_state(self, step: int, target: Any, *, in_flight_bytes: int) -> Any:
        """The whole state into ``target``'s shapes and shardings."""
        self._set_in_flight_limit(restore=in_flight_bytes)
        args = ocp.args.StandardRestore(target)
        return self._manager.restore(step, args=ocp.args.Composite(**{_STATE: args}))[_STATE]

    def read_entry(self, step: int, entry: str, target: Any, *, in_flight_bytes: int) -> Any:
        """``state[entry]`` alone into ``target`` (a partial restore)."""
        self._set_in_flight_limit(restore=in_flight_bytes)
        item = {entry: target}
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
        )
        return self._manager.restore(step, args=ocp.args.Composite(**{_STATE: args}))[_STATE][entry]

    def delete(self, step: int) -> None:
        self._manager.delete(step)

    def wait(self) -> None:
        """Block until pending saves are committed (raises a background save's error)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

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
