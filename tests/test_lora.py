"""LoRA fine-tuning of a Llama under every layout: the numbers of one device, step 0 equal to the
base model, frozen parameters untouched, gradient sums and optimizer state for adapters alone."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import EQUIVALENCE_BATCH
from test_llama import MODEL, config
from test_trainer import batches

from theseus.accounting.memory import shard_bytes
from theseus.checkpoint.checkpointer import Checkpointer
from theseus.config import apply_overrides
from theseus.plot import read_metrics
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import abstract_with, path_str
from theseus.sharding.topology import Topology
from theseus.training.llama import LlamaTrainer
from theseus.training.run.loop import train
from theseus.training.run.mode import RunMode
from theseus.training.trainer import next_token_loss

LORA = ["finetune.lora_rank=8", "finetune.lora_alpha=16"]
# Two layers are enough for the layer scan; the widths are test_llama's (every feature on).
SMALL = MODEL.model_copy(update={"num_layers": 2})


def lora_config(per_device_batch_size: int, *overrides: str):
    return apply_overrides(config(per_device_batch_size, SMALL), [*LORA, *overrides])


def run(trainer: LlamaTrainer):
    """Three steps: losses, the initial and final parameters on the host."""
    state = trainer.init_state()
    initial = jax.device_get(state.params)
    losses = []
    for batch in batches(trainer):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), initial, jax.device_get(state.params)


@functools.cache
def reference():
    one_device = Topology.new(ShardingPolicy(), devices=jax.devices()[:1])
    trainer = LlamaTrainer(lora_config(EQUIVALENCE_BATCH), ShardingPolicy(), one_device)
    losses, _, final = run(trainer)
    # The base model (no adapters, same seed) on the first batch: step 0's loss.
    base = LlamaTrainer(config(EQUIVALENCE_BATCH, SMALL), ShardingPolicy(), one_device)
    tokens = jax.device_get(next(iter(batches(base))))[0]  # (examples, seq + 1)
    base_params = base.init_state().params

    @jax.jit
    def base_loss(params, tokens):
        return next_token_loss(nnx.merge(base.graphdef, params)(tokens[:, :-1]), tokens[:, 1:])

    return losses, final, float(base_loss(base_params, jnp.asarray(tokens)))


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize(
    "policy",
    [ShardingPolicy(tp=2), ShardingPolicy(fsdp=True), ShardingPolicy(tp=2, fsdp=True)],
    ids=lambda p: f"tp{p.tp}-fsdp{p.fsdp}",
)
def test_lora_matches_one_device(policy, accumulation):
    """Losses within 1e-5 relative and adapters within 1e-4 of one device over three steps;
    step 0 is the base model's loss; frozen parameters are bit-identical after training; the
    optimizer state and gradient sum hold the adapters alone."""
    replicas = 8 // policy.tp
    trainer = LlamaTrainer(lora_config(EQUIVALENCE_BATCH // (replicas * accumulation)), policy)
    assert trainer.batch_plan.accumulation_steps == accumulation
    losses, initial, final = run(trainer)
    ref_losses, ref_final, base_loss = reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(losses[0], base_loss, rtol=1e-5)
    assert losses[-1] < losses[0]
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(final)[0], jax.tree.leaves(ref_final), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=str(path))
    trained, frozen = trainer.partition.split(final)
    _, frozen_before = trainer.partition.split(initial)
    for got, want in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_before), strict=True):
        np.testing.assert_array_equal(got, want)  # bit-identical
    assert {p.rsplit("/", 1)[-1] for p in _paths(trained)} == {"lora_a", "lora_b"}
    assert len(_paths(trained)) == 2 * 7  # q, k, v, o, gate, up, down


def _paths(tree) -> list[str]:
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


RUN = [
    "training.seq_len=16",
    "training.batch_size=16",
    "training.steps=3",
    "training.validation_interval=3",
    "training.validation_batches=1",
    "checkpointing.interval=1",
    "checkpointing.keep=3",
    "logging.progress_bar=false",
]


def test_lora_run_records_checkpoints_and_resumes(tmp_path):
    """run.json: the gradient sum and the optimizer state hold the adapters alone (bytes per
    device); checkpoints hold the adapters and point to their base (the seed's frozen
    parameters, by fingerprints); --resume from step 2 gives step 3's loss and adapters exactly."""
    policy = ShardingPolicy(tp=2, fsdp=True)
    config = apply_overrides(lora_config(2), RUN)
    trainer = LlamaTrainer(config, policy)
    out = tmp_path / "run"
    train(trainer, out, log=lambda _: None)
    trained, frozen = trainer.partition.split(trainer.abstract_state.params)
    storage, frozen_storage = trainer.partition.split(trainer.layouts.storage)
    adapters = shard_bytes(trained, storage)  # float32 adapters, per device
    record = json.loads((out / "run.json").read_text())["memory_per_device"]
    assert record["predicted"]["grad_accumulator_bytes"] == adapters
    for kind in ("predicted", "measured"):  # Adam's two moments of the adapters, two counters
        assert 2 * adapters <= record[kind]["optimizer_bytes"] <= 2 * adapters + 64
    assert record["measured"]["params_bytes"] == record["predicted"]["params_bytes"]
    assert record["predicted"]["params_bytes"] == adapters + shard_bytes(frozen, frozen_storage)

    target = abstract_with(trained, storage)
    with Checkpointer(out / "checkpoints", read_only=True) as checkpoints:
        saved = checkpoints.restore(3, target, params_only=True)  # the adapters are all it has
    assert saved.meta.base["run_dir"] is None and saved.meta.base["seed"] == 0
    assert set(saved.meta.base["fingerprints"]) == set(_paths(frozen))
    losses = [row["loss"] for row in read_metrics(out)]
    shutil.rmtree(out / "checkpoints" / "3")
    train(LlamaTrainer(config, policy), out, mode=RunMode(resume=True), log=lambda _: None)
    assert [row["loss"] for row in read_metrics(out)][-1] == losses[-1]
    with Checkpointer(out / "checkpoints", read_only=True) as checkpoints:
        again = checkpoints.restore(3, target, params_only=True)
    for got, want in zip(jax.tree.leaves(again.state), jax.tree.leaves(saved.state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
