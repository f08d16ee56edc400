"""Tests run on 8 simulated CPU devices; this must happen before JAX initialises.

One persistent compilation cache serves the whole test session: the controller makes it, its
workers and every subprocess the tests start inherit it through the environment, so a program that
several tests (or workers, or subprocesses) build is compiled once.
"""

import gc
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

# Compilation dominates these tests (tiny models, few steps), so XLA:CPU compiles cheaply: LLVM
# optimisation level 0 halves its time, and the classic fusion emitters take 2.4 times less than
# the default (MLIR) ones (a GPT train step: 3.25 s -> 1.34 s). Every comparison runs both sides
# under the same flags. The classic emitters round bfloat16 programs differently from the default
# ones, so a claim that two different bfloat16 programs give the same numbers bit for bit
# (tests/test_gather_dtype.py) compiles them with the default emitters
# (support.run_steps(..., compiler_options=support.DEFAULT_CODEGEN)).
#
# XLA:CPU splits each program's machine code into modules compiled on parallel threads; on two
# cores that two workers already keep busy the split only adds work: one module took 8-18% less
# CPU (tests/test_chunked_loss.py and test_olmo2.py together, 2026-12-03: 48.0 and 53.8 s against
# 44.3 and 43.9 s, alternating).
#
# XLA:CPU aborts a process when a device thread waits at a collective's rendezvous longer than
# its terminate timeout (40 s by default): raised to 10 minutes here, for a loaded machine. The
# thread pools get 4 threads a device (size_cpu_thread_pools, below): with XLA's default pools,
# waiting collectives took every thread and the process aborted (docs/testing.md, "The collective
# deadlock of the thread pools").


def _classic_emitters_flag() -> str:
    """jaxlib 0.10 keeps the classic emitters behind a flag; later ones dropped it, and an unknown
    XLA flag ends the process."""
    major, minor = (int(part) for part in version("jaxlib").split(".")[:2])
    return " --xla_cpu_use_fusion_emitters=false" if (major, minor) < (0, 11) else ""


DEVICES = 8  # simulated CPU devices

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={DEVICES} --xla_backend_optimization_level=0"
    + " --xla_cpu_parallel_codegen_split_count=1"
    + _classic_emitters_flag()
    + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
    + " --xla_cpu_collective_timeout_seconds=600"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The session's compilation cache (kept when the user names one). Workers see the controller's.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="theseus-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# No size limit (JAX's default). A limit turns on JAX's file lock, and its eviction check lists
# and reads every entry's files on every write: 93 ms a write at 1,100 entries, about a minute of
# the suite's CPU, with the lock held (docs/testing.md, "The suite's budget"). Without the lock a
# process could read an entry another one is still writing: JAX's read then fails to decompress
# it, warns and compiles the program itself, the same program.

from theseus.cli.options import (  # noqa: E402 (the environment first)
    collect_garbage_less_often,
    size_cpu_thread_pools,
)

size_cpu_thread_pools(DEVICES)

import jax  # noqa: E402

pytest_plugins = ["compile_report"]

assert jax.device_count() == DEVICES, (
    f"tests need {DEVICES} simulated CPU devices; XLA_FLAGS came too late"
)

# Tracing makes millions of short-lived objects, and a worker holds every module it imported and
# every trainer it shares: Python's collector, with its default thresholds, spent about 5% of a
# worker's CPU walking them (tests/test_trainer.py alone: 7.1 of 152 s, 17 full collections of
# 0.3 s each). Here a collection waits for 20,000 new objects, as in every `theseus` command, and
# what the collected test modules imported leaves its view (pytest_collection_finish): 1.5 s, no
# full collection. (docs/testing.md, "The suite's budget".)
collect_garbage_less_often()


def pytest_unconfigure(config):
    """The controller (or a run without workers) removes the cache it made."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Test modules that share fixtures or programs run in one group, on one worker; every other module
# is a group of its own. Groups listed in FIRST start first, longest first (CPU seconds of each
# file alone: docs/testing.md, "The suite's budget"), so the short groups come last and the two
# workers finish together; a long group started last would run on alone. The Hugging Face group
# loads torch; it is long with the reference libraries (CI) and short without them (the README's
# command).
SHARED_GROUPS = {
    "test_hf": "huggingface",
    "test_lora_hf": "huggingface",
    "test_chat_data": "huggingface",
    "test_harness": "huggingface",
    "test_moe_hf": "huggingface",
    "test_moe_lora": "huggingface",
    "test_rl_rewards": "huggingface",  # its transformers reference needs the group's torch
    "test_rl_trl": "huggingface",  # TRL's GRPOTrainer on a transformers model
}
FIRST = (
    "test_multiprocess",
    "test_trainer",
    "test_rl",
    "test_readme",
    "huggingface",
    "test_cli",
    "test_gather_dtype",
    "test_gemma",
    "test_planner",
    "test_checkpoint",
    "test_llama",
    "test_lora",
    "test_runs",
    "test_generate",
    "test_execution",
)


def group_of(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return SHARED_GROUPS.get(module, module)


def pytest_collection_finish(session):
    """The imports are alive for good: the collector stops walking them."""
    gc.freeze()


def pytest_collection_modifyitems(session, config, items):
    """Tests in the order their groups start (a stable sort: within a group, as collected)."""
    rank = {name: index for index, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(FIRST)))


def pytest_xdist_make_scheduler(config, log):
    """Whole groups go to one worker each, in collection order. (pytest-xdist's own
    ``--dist loadgroup`` renames node ids to group them, which pytest 9.2's node ids ignore.)"""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)
