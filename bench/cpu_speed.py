"""The machine's speed at what the suite spends its CPU on: CPU seconds to trace, lower and compile
a fixed program (a 4-layer MLP's training step, sharded over 8 simulated CPU devices) a few times,
with the suite's XLA flags and no compilation cache. It uses JAX alone, so its figure moves with
the machine and the JAX version, not with theseus.

    python bench/cpu_speed.py          # prints `cpu speed: S s` (lower is faster)

`bench/suite_budget.sh` runs it before and after the suite: this shared machine's speed has
drifted by up to 44% within an hour (docs/testing.md, "The suite's budget"), so a budget figure is
read beside it.
"""

import os
import time

os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_parallel_codegen_split_count=1"
)

import jax  # after the environment: JAX reads it when it starts
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PROGRAMS = 24  # each a new trace and compile (a different learning rate is a different constant)
WIDTH, LAYERS = 96, 4


def step_program(learning_rate: float):
    """An MLP's step: loss, gradients, an Adam-like update; parameters sharded over ``shard``."""
    mesh = jax.make_mesh((4, 2), ("batch", "shard"))
    weights = NamedSharding(mesh, P(None, "shard"))
    batch = NamedSharding(mesh, P("batch", None))

    def loss(params, x):  # x: (examples, WIDTH)
        for w in params:
            x = jnp.tanh(x @ w)  # (examples, WIDTH)
        return jnp.mean(x**2)

    def step(params, moments, x):
        grads = jax.grad(loss)(params, x)
        moments = [0.9 * m + 0.1 * g * g for m, g in zip(moments, grads, strict=True)]
        params = [
            p - learning_rate * g / jnp.sqrt(m + 1e-8)
            for p, g, m in zip(params, grads, moments, strict=True)
        ]
        return params, moments

    shapes = [jax.ShapeDtypeStruct((WIDTH, WIDTH), np.float32, sharding=weights)] * LAYERS
    x = jax.ShapeDtypeStruct((64, WIDTH), np.float32, sharding=batch)
    return jax.jit(step).lower(shapes, shapes, x).compile()


def main() -> None:
    step_program(1.0)  # JAX's and XLA's own start-up, not timed
    start = time.process_time()
    for index in range(PROGRAMS):
        step_program(1e-3 * (index + 1))
    print(f"cpu speed: {time.process_time() - start:.2f} s")


if __name__ == "__main__":
    main()
