"""Tests run on 8 simulated CPU devices; this must happen before JAX initialises."""

import os
import shutil
import tempfile

# LLVM optimisation level 0 halves CPU compile time, which dominates these tests (tiny models,
# few steps); every comparison runs both sides under the same flags. XLA:CPU aborts the process
# when a device thread waits more than 40 s at a collective's rendezvous; on a loaded 2-core
# machine (two workers, each running 8 device threads and subprocesses) that happened to correct
# programs, so the limit is raised to 10 minutes.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session: its workers (xdist inherits this environment)
# and the subprocesses they start compile many identical programs (the same tiny trainers).
_CACHE_OWNER = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_OWNER:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="theseus-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402 (after the environment above)

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; XLA_FLAGS was set too late"


def pytest_sessionfinish(session, exitstatus):
    """The process that made the compilation cache (the xdist controller) removes it."""
    if _CACHE_OWNER and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    """The tests that load torch (tests/test_hf.py, the Hugging Face reference) run last, so in
    each worker they follow every other test. With torch loaded in the process, a later XLA
    step aborted the process (SIGABRT while test_trainer's tp=2 FSDP step ran; reproduced with
    ``pytest -n 0 tests/test_hf.py tests/test_trainer.py::test_deterministic_model_matches_one_device``;
    the cause is not found yet)."""
    items.sort(key=lambda item: item.path.name == "test_hf.py")
