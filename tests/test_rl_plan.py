"""The plan of an RL job (``NAME/train/rl``): its rollout's KV cache, gathered parameters and
generation temporaries beside the training step, against the compiled programs; its verdict
against a device's memory; a LoRA run's state holding the base once."""

from __future__ import annotations

import functools
import json
import math

import jax
import pytest
from support import LLAMA31_8B_CONFIG, invoke

import theseus.plan as planner
from theseus.accounting.memory import tree_bytes
from theseus.accounting.records import as_json
from theseus.config import apply_overrides
from theseus.jobs import get_job
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import shard_shape
from theseus.sharding.topology import Topology
from theseus.training.state import reference_of

JOB = "llama/train/rl"
# test_planner.py's Llama of the activation estimate at 512 tokens (one example per device, as
# that estimate is checked), rows of 384 prompt and 128 completion positions; 8 completions a
# step (4 prompts × 2), 8 a generation batch per step it feeds.
MODEL = (
    "model.vocab_size=264",
    "model.num_layers=2",
    "model.hidden_size=48",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=136",
    "model.max_position_embeddings=512",
    "training.seq_len=512",
    "training.dtype=bfloat16",
    "training.per_device_batch_size=1",
    "rl.max_completion_length=128",
    "rl.num_generations=2",
)
RUN = (*MODEL, "training.batch_size=8", "rl.steps_per_generation=2")
TP2_FSDP = ShardingPolicy(tp=2, fsdp=True)


def rl_config(*overrides: str):
    trainer_class = get_job(JOB).trainer_class
    return trainer_class, apply_overrides(trainer_class.config_class(), list(overrides))


@functools.cache
def compiled_plan() -> planner.Plan:
    """The plan of tp=2 + FSDP on 4 devices, its step and generation programs compiled."""
    trainer_class, config = rl_config(*RUN)
    return planner.plan(
        trainer_class, config, TP2_FSDP, 4, compile=True, alternatives=False,
        compare_remat=False,
    )  # fmt: skip


def test_rollout_state_and_activations_are_the_compiled_programs():
    plan = compiled_plan()
    trainer_class, config = rl_config(*RUN)
    trainer = trainer_class(config, TP2_FSDP, Topology.new(TP2_FSDP, devices=jax.devices()[:4]))
    rollout, step, programs = plan.rollout, plan.compiled, plan.compiled_rollout
    assert rollout.rows == 16 and rollout.rows_per_device == 8
    assert (rollout.prompt_width, rollout.cache_len) == (384, 512)
    # The KV cache is exactly what the decode step donates back to itself.
    assert rollout.kv_cache == programs.decode.aliased
    # The generation reads the parameters in the compute layout: under FSDP a gathered copy.
    compute = sum(
        math.prod(shard_shape(leaf.shape, sharding.spec, plan.mesh_shape)) * leaf.dtype.itemsize
        for leaf, sharding in zip(
            trainer.abstract_leaves, jax.tree.leaves(trainer.layouts.compute), strict=True
        )
    )
    assert compute < programs.prefill.arguments <= compute + rollout.tokens  # and the prompts
    assert 0 < rollout.gathered <= compute
    # The state and the step's completion rows are the compiled step's arguments.
    assert plan.totals.persistent + rollout.batch == pytest.approx(step.arguments, rel=0.01)
    # One microbatch's activations: the compiled step's temporaries.
    assert plan.activations.total == pytest.approx(step.temporaries, rel=0.15)
    # What the generation holds beyond the state: the programs' peak less the parameters they
    # share with the state (those it does not gather).
    shared = compute - rollout.gathered
    generation = rollout.generation - rollout.tokens
    assert generation == pytest.approx(programs.peak - shared, rel=0.15)
    # The run's peak: the larger of the compiled step and the compiled generation.
    compiled_peak = max(step.peak - step.aliased, plan.totals.persistent + programs.peak - shared)
    assert plan.total == pytest.approx(compiled_peak, rel=0.15)
    data = as_json(plan)
    assert data["rollout"]["kv_cache_bytes"] == rollout.kv_cache
    assert data["compiled_rollout"]["peak_bytes"] == programs.peak
    assert "compiled rollout, per device" in planner.render(plan)


def count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def test_lora_rl_holds_the_base_once():
    """A LoRA run's reference is its base with the adapters off: its state holds the model's
    parameters once, beside the adapters, as a LoRA SFT run's does; full fine-tuning with a KL
    term holds a frozen copy, the parameters twice."""
    one, lora_rank = ShardingPolicy(), "finetune.lora_rank=4"
    lora_class, lora_config = rl_config(*RUN, lora_rank, "rl.beta=0.04")
    lora = lora_class(lora_config, one, Topology.abstract(one, 1))
    full_class, full_config = rl_config(*RUN, "rl.beta=0.04")
    full = full_class(full_config, one, Topology.abstract(one, 1))
    frozen = lora.partition.frozen
    base = sum(math.prod(leaf.shape) for leaf in lora.abstract_leaves if leaf.path in frozen)
    adapters = sum(math.prod(x.shape) for x in lora.abstract_leaves if x.path not in frozen)
    assert base == full.num_params and adapters > 0
    assert reference_of(lora.abstract_state) is None and not lora.holds_reference
    assert count(lora.abstract_state.params) == base + adapters == lora.num_params
    assert lora.memory().params == tree_bytes(lora.abstract_state.params)
    sft_class = get_job("llama/train/pretrain").trainer_class
    sft = [*MODEL[:-2], "training.batch_size=8", lora_rank]  # without the rl section
    sft_config = apply_overrides(sft_class.config_class(), sft)
    fsdp = ShardingPolicy(fsdp=True)
    rl_plan = planner.plan(lora_class, lora_config, fsdp, 8, alternatives=False)
    sft_plan = planner.plan(sft_class, sft_config, fsdp, 8, alternatives=False)
    assert rl_plan.totals == sft_plan.totals
    assert full.holds_reference and count(reference_of(full.abstract_state)) == full.num_params
    assert full.memory().params == 2 * tree_bytes(full.abstract_state.params)


def test_llama_3_1_8b_on_8_devices_its_rollout_decides_the_verdict(tmp_path):
    """Under FSDP the generation reads a gathered float32 copy of the 8B parameters (32 GB a
    device) beside its KV cache: the rollout, not the training step, sets the peak."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B_CONFIG))
    flags = [
        "--hf",
        tmp_path,
        JOB,
        "--devices",
        "8",
        "--fsdp",
        "--activation-checkpointing",
        "full",
    ]
    run = ["training.seq_len=2048", "training.dtype=bfloat16", "training.batch_size=64"]
    run += ["training.per_device_batch_size=1", "rl.max_completion_length=1024"]
    fits = invoke("plan", *flags, *run, "--device-memory", "80GiB", "--json")
    assert fits.exit_code == 0, fits.output
    data = json.loads(fits.output)
    rollout, totals = data["rollout"], data["totals"]
    assert (rollout["rows"], rollout["rows_per_device"], rollout["cache_positions"]) == (
        64,
        8,
        2048,
    )
    # Keys and values of 32 layers, 8 rows, 2,048 positions, 8 kv heads of 128 in bfloat16, and
    # each slot's int32 position.
    assert rollout["kv_cache_bytes"] == 32 * 8 * 2048 * 1024 * 2 * 2 + 8 * 2048 * 4
    assert rollout["gathered_params_bytes"] == pytest.approx(4 * data["num_params"], rel=1e-3)
    step = totals["total_bytes"] + data["activations"]["activation_bytes"] + rollout["batch_bytes"]
    generation = totals["params_bytes"] + totals["optimizer_bytes"] + rollout["generation_bytes"]
    assert step < 40 * 2**30 < generation == data["total_bytes"] < 80 * 2**30
    assert data["policies"][0]["rollout"]["generation_bytes"] > 0
    text = invoke("plan", *flags, *run, "--device-memory", "80GiB").output
    assert "rollout of FSDP, 64 completions a generation batch (8 per device)" in text
    assert "parameters gathered to the compute layout 29.9 GiB" in text
    assert "memory: 46.7 GiB per device fits in 80 GiB" in text
    short = invoke("plan", *flags, *run, "--device-memory", "40GiB")
    assert short.exit_code == 1, short.output
    assert "verdict: FAILED" in short.output
    assert (
        "out of memory: FSDP needs 46.7 GiB per device (the larger of the training step"
        in short.output
    )
    assert "and the rollout, parameters and optimizer state" in short.output
    assert "KV cache 2 GiB of 8 rows × 2,048 positions" in short.output
    assert "rl.steps_per_generation (the rollout's rows)" in short.output
    # Other jobs' plans carry no rollout.
    plain = invoke("plan", "--hf", tmp_path, "--devices", "8", "--fsdp", *run[:4], "--json")
    assert plain.exit_code == 0, plain.output
    data = json.loads(plain.output)
    assert "rollout" not in data and "rollout" not in data["policies"][0]
