"""Tests run on 8 simulated CPU devices; this must happen before JAX initialises."""

import os

# LLVM optimisation level 0 halves CPU compile time, which dominates these tests (tiny models,
# few steps); every comparison runs both sides under the same flags. XLA:CPU aborts the process
# when a device thread waits more than 40 s at a collective's rendezvous; on a loaded 2-core
# machine (two workers, each running 8 device threads and subprocesses) that happened to correct
# programs, so the limits are raised to 10 minutes. (A rarer abort with no XLA message remains,
# once in a whole-suite run while a multi-device step ran; see the closing notes.)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
    + " --xla_cpu_collective_timeout_seconds=600"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; XLA_FLAGS was set too late"


def pytest_collection_modifyitems(session, config, items):
    """The tests that load torch (tests/test_hf.py and tests/test_lora_hf.py, the Hugging Face
    reference) run last in each worker. With torch loaded, a later multi-device XLA step aborted
    the process (SIGABRT in test_trainer's tp=2 FSDP step, after test_hf in the same process):
    torch's CPU threads starved XLA's device threads past XLA:CPU's 40 s collective rendezvous
    limit, the same abort heavy load alone produced. The limit is raised above; the order keeps
    torch's threads away from the other tests' timings."""
    items.sort(key=lambda item: item.path.name in ("test_hf.py", "test_lora_hf.py"))
