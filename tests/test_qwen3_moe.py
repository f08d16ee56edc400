"""The Qwen3-MoE family in training: the load-balancing loss the step adds and records, layouts
with microbatches of one size equal to one device, its parameter count, plan and FLOPs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import (
    FAMILIES,
    assert_same_numbers,
    equivalence_config,
    invoke,
    policy_config,
    run_steps,
    shared_trainer,
    step_batch,
)

from theseus.model.experts import aux_loss
from theseus.plan import build as planner
from theseus.plan.policies import communication
from theseus.plot import read_metrics
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import LayoutError
from theseus.training.losses import next_token_loss

FAMILY = FAMILIES["qwen3_moe"].family
Qwen3MoeConfig = FAMILY.config_class
# 8 experts (over shard × batch on 8 devices), 2 per token, each 16 wide (split 8 ways by tp=2 +
# FSDP); q/k norms, GQA (8 heads, 2 kv).
MODEL = Qwen3MoeConfig(
    vocab_size=256,
    hidden_size=40,
    intermediate_size=48,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=24,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    router_aux_loss_coef=0.05,
    router_z_loss_coef=0.01,  # opt-in; on here so every layout test covers it
)


def test_step_records_the_load_balancing_loss():
    """One device: the step's ``aux_loss`` (and ``router_z_loss``) are the losses of the
    batch's routing, ``loss`` the token loss alone, ``expert_load`` each expert's share of the
    choices."""
    trainer = shared_trainer(equivalence_config(32, MODEL), ShardingPolicy(), num_devices=1)
    state = trainer.init_state()
    model = nnx.merge(trainer.graphdef, jax.device_get(state.params))
    batch = step_batch(trainer, 0)  # (1, 32, seq + 1)
    rows = jnp.asarray(jax.device_get(batch))[0]
    out = nnx.jit(lambda m, ids: m.outputs(ids))(model, rows[:, :-1])  # op by op: seconds
    sums = out.routing
    want_aux = aux_loss(sums, sums.counts, sums.rows)
    _, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["aux_loss"], want_aux, rtol=1e-6)
    np.testing.assert_allclose(metrics["router_z_loss"], sums.z / sums.rows, rtol=1e-6)
    assert float(metrics["router_z_loss"]) > 0
    assert float(metrics["dropped_fraction"]) == 0.0  # dropless
    np.testing.assert_allclose(metrics["loss"], next_token_loss(out.logits, rows[:, 1:]), rtol=1e-6)
    load = np.asarray(metrics["expert_load"])
    np.testing.assert_allclose(load, out.routing.counts / out.routing.counts.sum(), rtol=1e-6)
    assert load.shape == (8,) and abs(load.sum() - 1) < 1e-6


# (policy, microbatches per step of 32 examples on 8 devices). Experts left to the layouts
# ("none") run under tp=2 alone; under FSDP they are stored and gathered a layer at a time as a
# dense family's MLP is (tests/support.py's family matrix), so FSDP runs with experts placed.
CASES = [
    (ShardingPolicy(tp=2), 2),  # replicas accumulate on their own: the statistics cross them
    (ShardingPolicy(tp=2, fsdp=True, experts="shard"), 1),
    (ShardingPolicy(tp=2, fsdp=True, experts="batch"), 1),
    (ShardingPolicy(tp=2, fsdp=True, experts="both"), 2),
]


@pytest.mark.parametrize(("policy", "accumulation"), CASES, ids=lambda c: str(c))
def test_layouts_with_microbatches_of_one_size_match_one_device(policy, accumulation):
    """Losses within 1e-5 relative and parameters within 1e-4 of one device running the same
    microbatches (the load-balancing loss is taken per microbatch, all replicas together)."""
    trainer = shared_trainer(policy_config(policy, accumulation, MODEL), policy)
    assert trainer.batch_plan.accumulation_steps == accumulation
    single = equivalence_config(32 // accumulation, MODEL)
    reference = shared_trainer(single, ShardingPolicy(), num_devices=1)
    assert reference.batch_plan.accumulation_steps == accumulation
    assert_same_numbers(run_steps(trainer), run_steps(reference))


def test_parameter_count_names_and_active_matmuls():
    """The plan's names for the expert block; the count is the model's; FLOPs count the two
    chosen experts and the router, not all four experts."""
    trainer = shared_trainer(equivalence_config(4, MODEL), ShardingPolicy(tp=2, fsdp=True))
    names = {leaf.path: leaf.names for leaf in trainer.abstract_leaves}
    assert names["layers/mlp/gate_proj/weight"] == ("n_layer", "n_expert", "n_expert_mlp", "n_embd")
    assert names["layers/mlp/gate/weight"] == ("n_layer", "n_expert", "n_embd")
    assert trainer.num_params == FAMILY.num_params(MODEL)
    assert "layers/mlp/down_proj/weight" in trainer.per_layer_paths  # gathered one layer at a time
    fewer = MODEL.model_copy(update={"num_experts": 4})
    assert FAMILY.num_params(MODEL) - FAMILY.num_params(fewer) == 2 * 4 * 40 * (1 + 3 * 16)
    weights = FAMILY.matmuls(MODEL).other_weights  # each layer's MLP: the router, two experts
    assert weights == ((40, 8), (40, 32), (40, 32), (32, 40)) * 2


def test_an_expert_count_the_mesh_cannot_divide_is_refused():
    """Six experts over batch=4: pre-flight names the expert dimension and the fix."""
    six = MODEL.model_copy(update={"num_experts": 6})
    policy = ShardingPolicy(tp=2, experts="batch")
    with pytest.raises(LayoutError, match=r"dim 1 \(n_expert\) of size 6") as error:
        shared_trainer(policy_config(policy, 1, six), policy)
    assert "--experts none|shard|batch|both" in str(error.value)


QWEN3_30B_A3B = {  # the published config.json's keys that matter (transformers 4.51 wrote it)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
}  # fmt: skip


def test_plan_qwen3_30b_a3b_with_experts_placed_each_way(tmp_path):
    """`plan --hf` counts Qwen3-30B-A3B's parameters as transformers does and sizes its model
    state with the experts whole, over shard, over batch and over both (docs/performance.md)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    training = ["training.seq_len=4096", "training.batch_size=64", "training.dtype=bfloat16"]
    totals = {}
    for placement in ("none", "shard", "batch", "both"):
        flags = ("--devices", "64", "--tp", "8", "--experts", placement, "--json")
        result = invoke("plan", "--hf", tmp_path, *flags, *training)
        assert result.exit_code == 0, result.output
        plan = json.loads(result.output)
        assert plan["num_params"] == 30_532_122_624  # transformers' count (meta device)
        assert plan["policy"]["experts"] == placement
        totals[placement] = plan["totals"]["total_bytes"]  # ZeRO tp=8, per device
    assert totals["both"] < totals["batch"] < totals["shard"] < totals["none"], totals


def test_a_config_whose_layers_have_no_experts_is_refused(tmp_path):
    """decoder_sparse_step 2 with every odd layer in mlp_only_layers leaves no expert layer:
    `plan --hf` exits 2 naming both keys and the fix."""
    only = list(range(1, 48, 2))
    hf = QWEN3_30B_A3B | {"decoder_sparse_step": 2, "mlp_only_layers": only}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    result = invoke("plan", "--hf", tmp_path, "--devices", "8")
    assert result.exit_code == 2
    assert "no layer has experts" in result.output and "list fewer mlp_only_layers" in result.output


def test_compiled_plan_has_the_exchange_its_communication_line_names():
    """`plan --compile` of experts over batch (tp=2 + FSDP): the line names the all-to-all
    dispatch and the compiled step runs all-to-alls; experts over shard are summed over shard
    instead (an all-reduce: each replica holds its tokens on every device of its row)."""
    policy = ShardingPolicy(tp=2, fsdp=True, experts="batch")
    config = policy_config(policy, 1, MODEL)
    trainer_class = FAMILIES["qwen3_moe"].trainer_class
    plan = planner.plan(
        trainer_class, config, policy, 8, compile=True, alternatives=False, compare_remat=False
    )
    line = communication(plan.policy)
    assert "experts split over batch" in line and "by all-to-all over batch" in line
    assert plan.compiled.collectives["all-to-all"].bytes > 0
    shard = communication(policy.merge(experts="shard"))
    assert "all-reduces the outputs over shard" in shard and "all-to-all" not in shard


def test_cli_run_records_routing_in_its_metrics_rows(tmp_path):
    """`theseus train --job qwen3_moe/train/pretrain --experts shard`: every row has the
    load-balancing loss, each expert's load (a dict by index) and the dropped fraction."""
    defaults = FAMILY.config_class().model_dump()
    changed = {k: v for k, v in MODEL.model_dump().items() if v != defaults[k]}
    model = [f"model.{k}={v}" for k, v in changed.items()]
    training = ["training.steps=2", "training.batch_size=8", "training.per_device_batch_size=1",
                "training.validation_batches=1"]  # fmt: skip
    flags = ("--job", "qwen3_moe/train/pretrain", "--tp", "2", "--experts", "shard")
    result = invoke("train", *flags, "--out", tmp_path / "run", *model, *training)
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["aux_loss"] > 0 and row["router_z_loss"] > 0 and row["dropped_fraction"] == 0
        assert sorted(row["expert_load"], key=int) == [str(i) for i in range(8)]
        assert abs(sum(row["expert_load"].values()) - 1) < 1e-5
