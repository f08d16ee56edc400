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
