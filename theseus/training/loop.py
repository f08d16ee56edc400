"""The training loop: data in, steps dispatched, metrics read one step late, records written."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jax

from theseus.data import Corpus, Sampler, load_corpus, validation_batches
from theseus.training.base import BaseTrainer, TrainState


@dataclass(frozen=True)
class RunSummary:
    """What a finished run reports."""

    steps: int
    first_loss: float
    final_loss: float
    initial_val_loss: float
    final_val_loss: float | None
    seconds: float


def load_data(trainer: BaseTrainer) -> Corpus:
    data = trainer.config.data
    corpus = load_corpus(
        data.path, validation_fraction=data.validation_fraction, token_dtype=data.token_dtype
    )
    trainer.check_corpus(corpus)
    return corpus


def validation_array(trainer: BaseTrainer, corpus: Corpus) -> jax.Array:
    """Held-out batches as one sharded array (batches × accumulation, examples, seq_len + 1).

    Each held-out batch is ``training.batch_size`` examples split like a training batch, so the
    examples, and hence the loss, do not depend on the mesh.
    """
    plan = trainer.batch_plan
    num = trainer.config.training.validation_batches * plan.accumulation_steps
    batches = validation_batches(
        corpus.validation, plan.seq_len, num, plan.examples_per_microbatch
    )  # (num, examples, seq_len + 1)
    return trainer.put_batch(lambda rows: batches[:, rows], batches.shape)


def train_batch(trainer: BaseTrainer, sampler: Sampler, position: int) -> jax.Array:
    plan = trainer.batch_plan
    shape = (plan.accumulation_steps, plan.examples_per_microbatch, plan.seq_len + 1)
    return trainer.put_batch(
        lambda rows: sampler.local_batch(
            position, plan.accumulation_steps, plan.examples_per_microbatch, rows
        ),
        shape,
    )


def write_run_record(trainer: BaseTrainer, out_dir: Path, corpus: Corpus, state: TrainState):
    plan = trainer.batch_plan
    record = {
        "policy": trainer.policy.model_dump(),
        "mesh_shape": trainer.topology.mesh_shape,
        "num_devices": trainer.topology.num_devices,
        "num_processes": trainer.topology.num_processes,
        "replicas": plan.replicas,
        "per_device_batch_size": plan.per_device_batch_size,
        "accumulation_steps": plan.accumulation_steps,
        "global_batch_size": plan.global_batch_size,
        "seq_len": plan.seq_len,
        "num_params": trainer.num_params,
        "memory_per_device": asdict(trainer.memory_facts(state)),
        "data": corpus.source,
        "config": trainer.config.model_dump(mode="json"),
    }
    (out_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")


def train(
    trainer: BaseTrainer, out_dir: str | Path, *, log: Callable[[str], None] = print
) -> RunSummary:
    """Train for ``training.steps`` steps, writing ``run.json`` and ``metrics.jsonl`` to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    training = trainer.config.training
    plan = trainer.batch_plan
    corpus = load_data(trainer)
    sampler = Sampler(corpus.train, plan.seq_len, training.seed)
    validation = validation_array(trainer, corpus)
    log(plan.describe())
    log(
        f"model: {trainer.num_params:,} parameters; policy {trainer.policy.describe()}; "
        f"mesh {trainer.topology.mesh_shape}; data {corpus.source}"
    )

    state = trainer.init_state()
    write_run_record(trainer, out_dir, corpus, state)
    initial_val_loss = trainer.validation_step(state.params, validation)
    tokens_per_step = plan.global_batch_size * plan.seq_len
    losses: list[float] = []
    val_losses: list[float] = []
    start = time.perf_counter()
    pending: tuple[int, dict, jax.Array | None] | None = None

    with open(out_dir / "metrics.jsonl", "w") as metrics_file:

        def record(step: int, metrics: dict, val_loss: jax.Array | None) -> None:
            # Reading these blocks only on the step already dispatched before this one.
            row = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
            row["tokens"] = step * tokens_per_step
            if val_loss is not None:
                row["val_loss"] = float(val_loss)
                val_losses.append(row["val_loss"])
            losses.append(row["loss"])
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            if step % training.log_interval == 0 or val_loss is not None or step == 1:
                elapsed = time.perf_counter() - start
                val = f" val_loss {row['val_loss']:.4f}" if val_loss is not None else ""
                log(
                    f"step {step}/{training.steps} loss {row['loss']:.4f}{val} "
                    f"lr {row['learning_rate']:.2e} {row['tokens'] / elapsed:,.0f} tokens/s"
                )

        for step in range(1, training.steps + 1):
            position = (step - 1) * plan.global_batch_size
            state, metrics = trainer.train_step(state, train_batch(trainer, sampler, position))
            val_loss = None
            if step % training.validation_interval == 0 or step == training.steps:
                val_loss = trainer.validation_step(state.params, validation)
            if pending is not None:
                record(*pending)
            pending = (step, metrics, val_loss)
        record(*pending)

    return RunSummary(
        steps=training.steps,
        first_loss=losses[0],
        final_loss=losses[-1],
        initial_val_loss=float(initial_val_loss),
        final_val_loss=val_losses[-1] if val_losses else None,
        seconds=time.perf_counter() - start,
    )

