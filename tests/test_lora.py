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
from support import (
    EQUIVALENCE_BATCH,
    EQUIVALENCE_LLAMA,
    GPTTrainer,
    LlamaTrainer,
    assert_same_numbers,
    equivalence_config,
    invoke,
    one_device_run,
    policy_config,
    policy_id,
    run_steps,
    shared_trainer,
    step_batch,
)

from theseus.accounting.memory import shard_bytes
from theseus.checkpoint.checkpointer import Checkpointer
from theseus.config import apply_overrides
from theseus.plot import read_metrics
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import abstract_with, path_str
from theseus.training.run.loop import train
from theseus.training.run.mode import RunMode
from theseus.training.trainer import next_token_loss

LORA = ["finetune.lora_rank=8", "finetune.lora_alpha=16"]
# Two layers are enough for the layer scan; the widths are test_llama's (every feature on).
SMALL = EQUIVALENCE_LLAMA.model_copy(update={"num_layers": 2})


def lora_config(per_device_batch_size: int, *overrides: str):
    return equivalence_config(per_device_batch_size, SMALL, *LORA, *overrides)


@functools.cache
def base_loss() -> float:
    """The base model (no adapters, same seed) on the first batch: step 0's loss."""
    base = shared_trainer(
        equivalence_config(EQUIVALENCE_BATCH, SMALL), ShardingPolicy(), num_devices=1
    )
    tokens = jax.device_get(step_batch(base, 0))[0]  # (examples, seq + 1)

    @jax.jit
    def loss(params, tokens):
        return next_token_loss(nnx.merge(base.graphdef, params)(tokens[:, :-1]), tokens[:, 1:])

    return float(loss(base.init_state().params, jnp.asarray(tokens)))


# Each policy once and each accumulation at least once: the trained/frozen partition is the
# trainer's, the same under every layout, and GPT's matrix (tests/test_trainer.py) crosses
# layouts with accumulation.
LORA_CASES = [
    (ShardingPolicy(tp=2), 1),
    (ShardingPolicy(fsdp=True, activation_checkpointing="full"), 4),
    (ShardingPolicy(tp=2, fsdp=True, activation_checkpointing="dots"), 4),
]


@pytest.mark.parametrize(
    ("policy", "accumulation"),
    LORA_CASES,
    ids=[f"{policy_id(policy)}-{accumulation}" for policy, accumulation in LORA_CASES],
)
def test_lora_matches_one_device(policy, accumulation):
    """Losses within 1e-5 relative and adapters within 1e-4 of one device over three steps
    (with activation checkpointing full and dots too); step 0 is the base model's loss; frozen
    parameters are bit-identical after training; the optimizer state and gradient sum hold the
    adapters alone."""
    trainer = shared_trainer(policy_config(policy, accumulation, SMALL, *LORA), policy)
    assert trainer.batch_plan.accumulation_steps == accumulation
    got = run_steps(trainer)
    assert_same_numbers(got, one_device_run(trainer.config))
    np.testing.assert_allclose(got.losses[0], base_loss(), rtol=1e-5)
    trained, frozen = trainer.partition.split(got.params)
    _, frozen_before = trainer.partition.split(got.initial)
    for value, before in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_before), strict=True):
        np.testing.assert_array_equal(value, before)  # bit-identical
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
    train(trainer, out)
    trained, frozen = trainer.partition.split(trainer.abstract_state.params)
    storage, frozen_storage = trainer.partition.split(trainer.layouts.storage)
    adapters = shard_bytes(trained, storage)  # float32 adapters, per device
    run_record = json.loads((out / "run.json").read_text())
    assert run_record["num_trained_params"] == sum(x.size for x in jax.tree.leaves(trained))
    record = run_record["memory_per_device"]
    assert record["predicted"]["grad_accumulator_bytes"] == adapters
    for kind in ("predicted", "measured"):  # Adam's two moments of the adapters, two counters
        assert 2 * adapters <= record[kind]["optimizer_bytes"] <= 2 * adapters + 64
    assert record["measured"]["params_bytes"] == record["predicted"]["params_bytes"]
    assert record["predicted"]["params_bytes"] == adapters + shard_bytes(frozen, frozen_storage)

    target = abstract_with(trained, storage)
    with Checkpointer(out / "checkpoints", read_only=True) as checkpoints:
        saved = checkpoints.restore_params(3, target)  # the adapters are all it has
    assert saved.meta.base["run_dir"] is None and saved.meta.base["seed"] == 0
    assert set(saved.meta.base["fingerprints"]) == set(_paths(frozen))
    losses = [row["loss"] for row in read_metrics(out)]
    shutil.rmtree(out / "checkpoints" / "3")
    train(LlamaTrainer(config, policy), out, mode=RunMode(resume=True))
    assert [row["loss"] for row in read_metrics(out)][-1] == losses[-1]
    with Checkpointer(out / "checkpoints", read_only=True) as checkpoints:
        again = checkpoints.restore_params(3, target)
    for got, want in zip(jax.tree.leaves(again.state), jax.tree.leaves(saved.state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_finetune_settings_are_one_paragraph(tmp_path):
    """A lora_targets or freeze pattern that matches nothing, a negative rank, and targets
    without a rank: exit 2, one paragraph naming the setting, nothing written."""
    cases = [
        (["finetune.lora_rank=8", "finetune.lora_targets=[q_proj, nothing_here]"],
         "finetune.lora_targets pattern 'nothing_here' matches no projection weight"),
        (["finetune.lora_rank=-2"], "finetune.lora_rank=-2 must be >= 0"),
        (["finetune.lora_targets=[n_mlp]"], "but finetune.lora_rank=0; set a positive"),
        (["finetune.freeze=[embed]"], "finetune.freeze pattern 'embed' matches no parameter"),
        (["finetune.freeze=[layers/*, '*']"], "freezes every parameter"),
    ]  # fmt: skip
    for overrides, expected in cases:
        result = invoke(
            "train", "--job", "llama/train/pretrain", "--out", tmp_path / "run", *overrides
        )
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: ") and "Traceback" not in result.output
        assert expected in " ".join(result.output.split()), result.output
        assert not (tmp_path / "run").exists()


def test_plan_llama31_8b_lora_fits_17_gb_on_one_device():
    """theseus plan, Llama 3.1 8B in bfloat16 on one device: with LoRA rank 16 the model state
    (bfloat16 frozen weights, float32 adapters with their gradient sum and Adam moments) is at
    most 17 GB; full fine-tuning needs 16 bytes per parameter (about 128 GB)."""
    llama8b = [
        "model.vocab_size=128256", "model.hidden_size=4096", "model.intermediate_size=14336",
        "model.num_layers=32", "model.num_heads=32", "model.num_kv_heads=8",
        "model.max_position_embeddings=131072", "model.rope_theta=500000.0",
        "model.rope_type=llama3", "training.seq_len=2048", "training.batch_size=1",
        "training.dtype=bfloat16", "training.per_device_batch_size=1",
    ]  # fmt: skip
    plans = {}
    for name, extra in (("lora", ["finetune.lora_rank=16"]), ("full", [])):
        result = invoke(
            "plan", "llama/train/pretrain", "--devices", "1", "--json", *llama8b, *extra
        )
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(result.output)
    lora, full = plans["lora"], plans["full"]
    base = full["num_params"]
    assert base == 8_030_261_248
    adapters = lora["num_params"] - base  # rank 16 on q, k, v, o, gate, up, down of 32 layers
    assert adapters == 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert lora["totals"]["params_bytes"] == 2 * base + 4 * adapters
    assert lora["totals"]["grad_accumulator_bytes"] == 4 * adapters
    assert lora["totals"]["total_bytes"] <= 17e9
    assert full["totals"]["total_bytes"] >= 16 * base
    assert {row["dtype"] for row in lora["rows"] if "lora" not in row["paths"][0]} == {"bfloat16"}


def test_gpt_lora_with_bfloat16_frozen_weights():
    """GPT takes adapters too: under tp=2 + FSDP with bfloat16 compute, its frozen weights are
    stored in bfloat16 (no float32 copy), gathered per layer and left bit-identical by two
    steps that train the float32 adapters."""
    config = apply_overrides(equivalence_config(8, dtype="bfloat16"), LORA)
    trainer = GPTTrainer(config, ShardingPolicy(tp=2, fsdp=True, activation_checkpointing="full"))
    dtypes = {leaf.path: leaf.dtype for leaf in trainer.abstract_leaves}
    assert dtypes["blocks/attn_q/kernel"] == jnp.bfloat16 and dtypes["wte"] == jnp.bfloat16
    assert dtypes["blocks/attn_q/lora_a"] == jnp.float32
    state = trainer.init_state()
    before = trainer.partition.split(jax.device_get(state.params))
    losses = []
    for index in range(2):
        state, metrics = trainer.train_step(state, step_batch(trainer, index))
        losses.append(float(metrics["loss"]))
    trained, frozen = trainer.partition.split(jax.device_get(state.params))
    assert np.isfinite(losses).all()
    for got, want in zip(jax.tree.leaves(frozen), jax.tree.leaves(before[1]), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(trained["blocks"]["attn_q"]["lora_b"], 0)
