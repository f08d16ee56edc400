"""What several test files share: a tiny GPT configuration and the environment of subprocesses."""

import os

# A GPT small enough to compile in seconds; 16 examples split over any of the 8 devices.
TINY_GPT = (
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=4",
    "model.block_size=16",
    "training.batch_size=16",
    "training.per_device_batch_size=2",
    "training.validation_interval=2",
    "training.validation_batches=1",
    "checkpointing.interval=2",
    "logging.progress_bar=false",
)


def subprocess_env() -> dict[str, str]:
    """This environment without the forced 8 devices: a subprocess picks its own count with
    --cpu-devices or jax_num_cpu_devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    return env
