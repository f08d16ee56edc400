"""What several test files share: tiny GPT configurations, the 7.5B configuration of the scale
tests and benches, tiny corpora, the CLI and the environment of subprocesses."""

import os
from pathlib import Path

from typer.testing import CliRunner, Result

from theseus.cli.app import app
from theseus.config import apply_overrides
from theseus.model import GPTConfig
from theseus.training.gpt import GPTTrainerConfig

# n_embd and n_mlp divide by 8 (tp=8 and FSDP over 8 devices); other dims differ from them.
# Dropout is on: per-example keys must make its masks the same under every layout.
EQUIVALENCE_MODEL = GPTConfig(
    vocab_size=256, block_size=24, n_layer=3, n_head=4, n_embd=40, mlp_ratio=4, dropout=0.1
)
EQUIVALENCE_BATCH = 32

# A GPT small enough to compile in seconds; 16 examples split over any of the 8 devices; with
# dropout, so that resumed and multi-process runs also show per-example keys at work.
TINY_GPT = (
    "model.n_layer=2",
    "model.dropout=0.1",
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


# About 7.5B parameters (Ψ = 7,464,640,512): the GPT of the planner's and FSDP's scale figures.
# The vocabulary is padded to 50432 = 197 × 256, so ZeRO divides it over up to 256 devices.
GPT_7_5B = (
    "model.vocab_size=50432",
    "model.block_size=2048",
    "model.n_layer=36",
    "model.n_head=32",
    "model.n_embd=4096",
)

# A few lines of text that tiny corpora repeat (bytes are tokens unless a tokenizer is trained).
TEXT = "Beautiful is better than ugly.\nExplicit is better than implicit.\nSimple beats complex.\n"


def write_corpus(folder: Path, num_files: int = 3) -> Path:
    """A folder of ``num_files`` small text files of different lengths; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(num_files):
        (folder / f"part{index}.txt").write_text(TEXT * (40 + 7 * index) + f"file {index}\n")
    return folder


def invoke(*args: object) -> Result:
    """Run the ``theseus`` command in this process (``result.exit_code``, ``result.output``)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def subprocess_env() -> dict[str, str]:
    """This environment without the forced 8 devices: a subprocess picks its own count with
    --cpu-devices or jax_num_cpu_devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    return env


def equivalence_config(
    per_device_batch_size: int, model: GPTConfig = EQUIVALENCE_MODEL, **training
) -> GPTTrainerConfig:
    """A global batch of 32 and a learning rate of 1e-3, small enough that parameters of
    different layouts agree to 1e-4 after a few Adam steps."""
    overrides = {
        "training.batch_size": EQUIVALENCE_BATCH,
        "training.per_device_batch_size": per_device_batch_size,
        "training.steps": 100,
        "optimization.learning_rate": 1e-3,
        "optimization.warmup_steps": 1,
        **{f"training.{k}": v for k, v in training.items()},
    }
    return apply_overrides(
        GPTTrainerConfig(model=model), [f"{k}={v}" for k, v in overrides.items()]
    )
