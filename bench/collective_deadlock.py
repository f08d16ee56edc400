"""Runs the train step of tests/test_llama.py's tp=2 + FSDP case (4 microbatches, 8 simulated
CPU devices) step after step, as the tests do, to catch XLA:CPU's collective deadlock: a device
thread that waits at a collective's rendezvous longer than ``--terminate`` seconds aborts the
process with XLA's message naming the rendezvous. ``--pools default`` keeps XLA:CPU's thread
pools at max(cores, devices) threads; ``--pools sized`` sizes them as the tests and
``--cpu-devices`` do (theseus.cli.options.size_cpu_thread_pools). Exit status 0: no deadlock.

    PYTHONPATH=. python bench/collective_deadlock.py --pools default --steps 500
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--pools", choices=("default", "sized"), required=True)
parser.add_argument("--steps", type=int, default=500)
parser.add_argument("--terminate", type=int, default=30, help="collective terminate timeout (s)")
args = parser.parse_args()

DEVICES = 8
# The test session's XLA flags (tests/conftest.py), with a short terminate timeout.
os.environ["XLA_FLAGS"] = " ".join(
    [
        f"--xla_force_host_platform_device_count={DEVICES}",
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
        f"--xla_cpu_collective_call_terminate_timeout_seconds={args.terminate}",
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=10",
    ]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from support import EQUIVALENCE_LLAMA, policy_config, shared_trainer, step_batch  # noqa: E402

from theseus.cli.options import size_cpu_thread_pools  # noqa: E402
from theseus.sharding.axis import ShardingPolicy  # noqa: E402

if args.pools == "sized":
    size_cpu_thread_pools(DEVICES)
print(f"PJRT_NPROC={os.environ.get('PJRT_NPROC', '(unset)')}, {os.cpu_count()} cores", flush=True)
policy = ShardingPolicy(tp=2, fsdp=True)
trainer = shared_trainer(policy_config(policy, 4, EQUIVALENCE_LLAMA), policy)
batches = [step_batch(trainer, index) for index in range(3)]
state = trainer.init_state()
start = time.perf_counter()
for index in range(args.steps):
    state, metrics = trainer.train_step(state, batches[index % 3])
    loss = float(metrics["loss"])  # one step at a time, as tests/support.py's run_steps
    if index % 50 == 0:
        print(f"step {index}: loss {loss:.4f}, {time.perf_counter() - start:.1f} s", flush=True)
print(f"{args.steps} steps, no deadlock, {time.perf_counter() - start:.1f} s", flush=True)
