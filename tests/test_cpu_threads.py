"""XLA:CPU's thread pools have room for every collective the simulated devices can have waiting
(theseus.cli.options.size_cpu_thread_pools): with the default max(cores, devices) threads, waiting
collectives took every thread and the suite lost workers (bench/collective_deadlock.py)."""

import contextlib
import os
import sys
from pathlib import Path

import jax
import pytest

from theseus.cli.options import CPU_THREADS_PER_DEVICE, size_cpu_thread_pools


@pytest.mark.skipif(sys.platform != "linux", reason="counts threads by name in /proc")
def test_the_test_session_pool_has_threads_for_every_device():
    """The pool XLA:CPU runs thunks and collectives on, counted by its threads' names, has
    CPU_THREADS_PER_DEVICE threads a device: PJRT_NPROC reached the backend."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            names.append((task / "comm").read_text().strip())
    pool = names.count("tf_XLAEigen")
    assert pool >= CPU_THREADS_PER_DEVICE * jax.device_count(), (pool, jax.device_count())


def test_sizing_sets_threads_per_device_and_keeps_a_users_value(monkeypatch):
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    size_cpu_thread_pools(16)
    assert os.environ["PJRT_NPROC"] == str(max(os.cpu_count(), CPU_THREADS_PER_DEVICE * 16))
    monkeypatch.setenv("PJRT_NPROC", "5")
    size_cpu_thread_pools(16)
    assert os.environ["PJRT_NPROC"] == "5"
