"""Tests run on 8 simulated CPU devices; this must happen before JAX initialises."""

import os

# LLVM optimisation level 0 halves CPU compile time, which dominates these tests (tiny models,
# few steps); every comparison runs both sides under the same flags.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; XLA_FLAGS was set too late"


def pytest_collection_modifyitems(session, config, items):
    """The tests that load torch (tests/test_hf.py, the Hugging Face reference) run last, so in
    each worker they follow every other test. With torch loaded in the process, a later XLA
    step aborted the process (SIGABRT while test_trainer's tp=2 FSDP step ran; reproduced with
    ``pytest -n 0 tests/test_hf.py tests/test_trainer.py::test_deterministic_model_matches_one_device``;
    the cause is not found yet)."""
    items.sort(key=lambda item: item.path.name == "test_hf.py")
