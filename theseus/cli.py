"""The ``theseus`` command line.

JAX reads the device configuration when its backend starts, so nothing here touches devices
before ``--cpu-devices`` has been applied; heavy imports happen inside the commands.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="theseus: train annotated JAX models under DP, TP, ZeRO or FSDP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def use_cpu_devices(count: int | None) -> None:
    """Simulate ``count`` CPU devices; must run before JAX's first operation."""
    if count is None:
        return
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def fail(message: str) -> None:
    """A user error: one paragraph on stderr, no traceback, exit status 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


@app.callback()
def main() -> None:
    """theseus: annotate a model once with logical axis names; train it under any layout."""


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="dotted config overrides, e.g. training.batch_size=16 model.n_layer=2",
            show_default=False,
        ),
    ] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel devices per replica")] = 1,
    zero: Annotated[
        bool, typer.Option(help="partition optimizer state and the update over batch (ZeRO)")
    ] = True,
    fsdp: Annotated[
        bool, typer.Option(help="also partition stored parameters over batch (needs ZeRO)")
    ] = False,
    activation_checkpointing: Annotated[
        bool, typer.Option(help="recompute each layer's activations in the backward pass")
    ] = False,
    cpu_devices: Annotated[
        int | None,
        typer.Option(help="simulate this many CPU devices (set before JAX starts)", min=1),
    ] = None,
    steps: Annotated[int | None, typer.Option(help="optimizer steps (training.steps)")] = None,
    seed: Annotated[int | None, typer.Option(help="seed of init and data order")] = None,
    out: Annotated[
        Path | None, typer.Option(help="run directory; default runs/<time stamp>")
    ] = None,
) -> None:
    """Train the default GPT (built-in data unless data.path is given)."""
    use_cpu_devices(cpu_devices)
    from theseus.base.axis import ShardingPolicy
    from theseus.config import apply_overrides
    from theseus.training.gpt import GPTTrainer, GPTTrainerConfig
    from theseus.training.loop import train as run_training

    extra = list(overrides or [])
    if steps is not None:
        extra.append(f"training.steps={steps}")
    if seed is not None:
        extra.append(f"training.seed={seed}")
    out = out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        config = apply_overrides(GPTTrainerConfig(), extra)
        policy = ShardingPolicy(
            tp=tp, zero=zero, fsdp=fsdp, activation_checkpointing=activation_checkpointing
        )
        trainer = GPTTrainer(config, policy)
        summary = run_training(trainer, out)
    except ValueError as error:
        fail(str(error))
    typer.echo(
        f"done: {summary.steps} steps in {summary.seconds:.1f} s; loss {summary.first_loss:.4f} "
        f"→ {summary.final_loss:.4f}; validation loss {summary.initial_val_loss:.4f} → "
        f"{summary.final_val_loss:.4f}; records in {out}"
    )


if __name__ == "__main__":
    sys.exit(app())
