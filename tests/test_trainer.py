"""Every policy trains GPT (with dropout) to the numbers of one device; layouts and memory match
the plan."""

import math

import jax
import numpy as np
import pytest
from support import (
    EQUIVALENCE_BATCH,
    EQUIVALENCE_MODEL,
    POLICIES,
    GPTTrainer,
    assert_same_numbers,
    equivalence_config,
    one_device_run,
    policy_config,
    policy_id,
    run_steps,
    shared_trainer,
    step_batch,
)

from theseus.accounting.collectives import count_collectives
from theseus.accounting.preflight import plan_batch
from theseus.config import apply_overrides
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import LayoutError
from theseus.sharding.topology import Topology
from theseus.training import gathering, step

MODEL = EQUIVALENCE_MODEL
GLOBAL_BATCH = EQUIVALENCE_BATCH
VALIDATION_BATCHES = 2

config = equivalence_config


def with_dropout(dropout: float):
    return MODEL.model_copy(update={"dropout": dropout})


def assert_matches_one_device(trainer: GPTTrainer):
    """Losses within 1e-5 relative over three steps, parameters within 1e-4, validation 1e-5."""
    got = run_steps(trainer, validation=VALIDATION_BATCHES)
    assert_same_numbers(got, one_device_run(trainer.config, validation=VALIDATION_BATCHES))
    assert got.step == 3


# Every policy in one microbatch; in 4, the policies whose gradients take each path between
# microbatches (theseus/training/gathering.py): whole on each replica, crossing batch once (DP,
# ZeRO), or with no batch to cross (tp=8). FSDP's sharded accumulator, reduced per microbatch, is
# test_activation_checkpointing_matches_one_device's (tp=2 + FSDP in 4 microbatches, with
# dropout; the three here show dropout's per-example keys unchanged by accumulation).
ACCUMULATED = [
    ShardingPolicy(tp=1, zero=False),
    ShardingPolicy(tp=1),
    ShardingPolicy(tp=8, zero=False),
]
MATRIX = [(policy, 1) for policy in POLICIES] + [(policy, 4) for policy in ACCUMULATED]


@pytest.mark.parametrize(
    ("policy", "accumulation"),
    MATRIX,
    ids=[f"{policy_id(policy)}-{accumulation}" for policy, accumulation in MATRIX],
)
def test_policy_matches_one_device(policy, accumulation):
    trainer = shared_trainer(policy_config(policy, accumulation), policy)
    assert trainer.batch_plan.accumulation_steps == accumulation
    assert trainer.batch_plan.global_batch_size == GLOBAL_BATCH
    assert trainer.config.model.dropout == 0.1
    assert_matches_one_device(trainer)


def test_dropout_changes_the_losses():
    """On one device, the model's dropout moves the losses by more than the tolerance, so the
    tests above and below can fail when a layout draws other masks."""
    dropout_losses = one_device_run(config(2), validation=VALIDATION_BATCHES).losses
    deterministic = config(2, with_dropout(0.0))
    deterministic_losses = one_device_run(deterministic, validation=VALIDATION_BATCHES).losses
    assert np.abs(dropout_losses / deterministic_losses - 1).max() > 1e-3


def shard_shapes(array):
    return {tuple(s.data.shape) for s in array.addressable_shards}


@pytest.mark.parametrize("policy", [ShardingPolicy(tp=2, fsdp=True), ShardingPolicy(tp=2)])
def test_state_shards_follow_layouts(policy):
    """TP with FSDP, and TP with ZeRO alone: the trainers (and compiled steps) of
    test_policy_matches_one_device's accumulation-1 cases."""
    trainer = shared_trainer(policy_config(policy, 1), policy)
    state = trainer.init_state()
    state, _ = trainer.train_step(state, step_batch(trainer, 0))
    layouts = trainer.layouts
    flat_params = jax.tree_util.tree_flatten_with_path(state.params)[0]
    storage = jax.tree.leaves(layouts.storage)
    update = jax.tree.leaves(layouts.update)
    adam = state.opt_state[1][0]
    for (path, param), store, upd, mu, nu in zip(
        flat_params,
        storage,
        update,
        jax.tree.leaves(adam.mu),
        jax.tree.leaves(adam.nu),
        strict=True,
    ):
        assert shard_shapes(param) == {store.shard_shape(param.shape)}, path
        assert param.sharding.is_equivalent_to(store, param.ndim), path
        assert shard_shapes(mu) == {upd.shard_shape(param.shape)}, path
        assert shard_shapes(nu) == {upd.shard_shape(param.shape)}, path
    params = state.params
    assert params["ln_f"]["scale"].sharding.is_fully_replicated
    assert params["wte"].sharding.is_fully_replicated == (not policy.fsdp)


def compiled_text(trainer: GPTTrainer) -> str:
    """The trainer's compiled step as text (a program another test ran: from the compilation
    cache)."""
    batch = jax.ShapeDtypeStruct(
        trainer.batch_plan.shape, np.int32, sharding=trainer.batch_sharding
    )
    return trainer.train_step.lower(trainer.abstract_state, batch).compile().as_text()


def test_step_without_fsdp_gathers_no_parameters():
    """TP without ZeRO or FSDP (test_policy_matches_one_device's tp=8 case, accumulation 4).
    (FSDP's gathers, one layer at a time: tests/test_gather_dtype.py.)"""
    policy = ShardingPolicy(tp=8, zero=False)
    assert "all-gather" not in compiled_text(shared_trainer(policy_config(policy, 4), policy))


def replicated_bytes(trainer):
    """Bytes of the parameters FSDP leaves whole, with their two float32 Adam moments."""
    return sum(
        math.prod(leaf.shape) * 4 * 3
        for leaf, sharding in zip(
            trainer.abstract_leaves, jax.tree.leaves(trainer.layouts.storage), strict=True
        )
        if sharding.is_fully_replicated
    )


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"tp{p.tp}-zero{p.zero}-fsdp{p.fsdp}")
def test_measured_memory_matches_layouts(policy):
    trainer = shared_trainer(policy_config(policy, 1), policy)
    measured = trainer.measured_memory(trainer.init_state())
    assert measured.persistent / trainer.memory().persistent == pytest.approx(1.0, abs=0.02)


def test_fsdp_memory_is_an_eighth_plus_replicated_leaves():
    single = shared_trainer(config(GLOBAL_BATCH), ShardingPolicy(), num_devices=1)
    single_bytes = single.measured_memory(single.init_state()).persistent
    fsdp = shared_trainer(config(4), ShardingPolicy(fsdp=True))
    fsdp_bytes = fsdp.measured_memory(fsdp.init_state()).persistent
    replicated = replicated_bytes(fsdp)
    expected = (single_bytes - replicated) / 8 + replicated
    assert fsdp_bytes == pytest.approx(expected, rel=0.02)
    assert fsdp_bytes < single_bytes / 4


def test_batch_plan_errors_name_three_numbers():
    topology = Topology.new(ShardingPolicy(tp=2))
    bad = config(3).training
    with pytest.raises(ValueError, match=r"batch_size=32.*per_device_batch_size=3.*4 replicas"):
        plan_batch(bad, topology, 24)


def test_preflight_failure_allocates_nothing():
    cfg = apply_overrides(config(4), ["model.n_embd=100", "model.n_head=4"])
    before = len(jax.live_arrays())
    with pytest.raises(LayoutError) as failure:
        GPTTrainer(cfg, ShardingPolicy(fsdp=True))
    assert len(jax.live_arrays()) == before
    message = str(failure.value)
    for path in ("blocks/attn_q/kernel", "blocks/attn_out/kernel", "blocks/attn_v/bias"):
        assert any(p.leaf.path.startswith(path) for p in failure.value.problems), message
    assert "blocks/attn_q/kernel: shape (3, 100, 100)" in message
    assert "storage and update spec P(None, None, ('shard', 'batch'))" in message
    assert "batch=8, shard=1" in message
    assert "mlp" not in message  # n_mlp = 400 divides by 8


def collective_lines(hlo: str) -> list[str]:
    return [
        line
        for line in hlo.splitlines()
        if " all-reduce(" in line or " reduce-scatter(" in line or "all-reduce-start(" in line
    ]


def test_bfloat16_compute_reduces_gradients_in_float32():
    """Under FSDP (the program the test below trains): its reduce-scatters carry float32.
    Gradients leave the loss as float32 (``replica_grads``) before any layout's reduction, so
    ZeRO's and DP's all-reduces take the same values."""
    trainer = shared_trainer(config(2, dtype="bfloat16"), ShardingPolicy(fsdp=True))
    reductions = collective_lines(compiled_text(trainer))
    assert reductions, "a data-parallel step must reduce gradients across replicas"
    assert not [line for line in reductions if "bf16" in line], "gradients reduced in bfloat16"
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(trainer.abstract_state.params))


def test_parameters_stored_as_computed_enter_as_computed_without_a_trace():
    """No FSDP: every parameter is stored in its compute layout, so the entry does not ask for
    the per-layer paths (an abstract trace of the loss) and is what they would give: the compute
    layout, nothing cast before a move (bfloat16). Under FSDP the entry asks for them."""
    for policy in (ShardingPolicy(), ShardingPolicy(tp=2, zero=False)):
        trainer = shared_trainer(config(2, dtype="bfloat16"), policy)
        entry = gathering.entry(trainer.context, lambda: pytest.fail("the paths were traced"))
        assert "blocks/attn_q/kernel" in trainer.per_layer_paths  # traced when asked for
        assert entry.layout == gathering.entry_layout(trainer.layouts, trainer.per_layer_paths)
        assert entry.layout == trainer.layouts.compute and entry.casts == frozenset()
    fsdp = shared_trainer(config(2, dtype="bfloat16"), ShardingPolicy(fsdp=True))
    asked = []

    def paths() -> frozenset[str]:
        asked.append(True)
        return fsdp.per_layer_paths

    gathering.entry(fsdp.context, paths)
    assert asked == [True]


def test_bfloat16_training_tracks_float32():
    """Under FSDP: the program whose reductions the test above reads."""
    policy = ShardingPolicy(fsdp=True)
    got = run_steps(shared_trainer(config(2, dtype="bfloat16"), policy))
    ref_losses = one_device_run(config(2), validation=VALIDATION_BATCHES).losses
    np.testing.assert_allclose(got.losses, ref_losses, rtol=2e-2)  # bfloat16: 8 mantissa bits
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(got.params))


def test_activation_checkpointing_matches_one_device():
    """Under the dots policy the recomputed layers draw the same dropout masks (GPT is the
    family with dropout; the full policy, and dots again, run on Gemma and LoRA's Llama:
    tests/test_gemma.py, tests/test_lora.py); tp=2 + FSDP in 4 microbatches, the matrix's
    sharded gradient accumulator."""
    policy = ShardingPolicy(tp=2, fsdp=True, activation_checkpointing="dots")
    trainer = shared_trainer(config(2), policy)
    assert trainer.batch_plan.accumulation_steps == 4
    batch_shape = (trainer.batch_plan.accumulation_steps, 16, trainer.seq_len + 1)
    batch = jax.ShapeDtypeStruct(batch_shape, np.int32, sharding=trainer.batch_sharding)
    traced = step.train_step(trainer.context, trainer.entry)
    jaxpr = str(jax.make_jaxpr(traced)(trainer.abstract_state, batch))
    assert "remat" in jaxpr or "checkpoint" in jaxpr
    assert_matches_one_device(trainer)  # the recomputed layers draw the same dropout masks


@pytest.mark.parametrize(
    "policy", [ShardingPolicy(zero=False), ShardingPolicy()], ids=["DP", "ZeRO"]
)
def test_gradients_cross_batch_once_per_step(policy):
    """4 accumulation steps of one example per replica (test_policy_matches_one_device's
    program): the float32 gradients cross batch once (the bytes of one step without
    accumulation), not once per microbatch."""
    trainer = shared_trainer(policy_config(policy, 4), policy)
    assert trainer.batch_plan.accumulation_steps == 4
    assert trainer.batch_plan.per_device_batch_size == 1
    found = count_collectives(compiled_text(trainer))
    gradient_bytes = 4 * trainer.num_params
    reduced = found["all-reduce"].bytes + found["reduce-scatter"].bytes
    assert reduced == pytest.approx(gradient_bytes, rel=0.05), (reduced, gradient_bytes)
