"""The Qwen3-MoE family in training: the load-balancing loss the step adds and records, layouts
with microbatches of one size equal to one device, its parameter count, plan and FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import (
    FAMILIES,
    assert_same_numbers,
    equivalence_config,
    policy_config,
    run_steps,
    shared_trainer,
    step_batch,
)

from theseus.model.experts import aux_loss
from theseus.model.families.qwen3_moe import Qwen3MoeConfig
from theseus.sharding.axis import ShardingPolicy
from theseus.training.losses import next_token_loss

FAMILY = FAMILIES["qwen3_moe"].family
# 4 experts, 2 per token, 16 wide (split 8 ways by tp=2 + FSDP); q/k norms, GQA (8 heads, 2 kv).
MODEL = Qwen3MoeConfig(
    vocab_size=256,
    hidden_size=40,
    intermediate_size=48,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=24,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    router_aux_loss_coef=0.05,
)


def test_step_records_the_load_balancing_loss():
    """One device: the step's ``aux_loss`` is the loss of the batch's routing, ``loss`` the
    token loss alone, ``expert_load`` each expert's share of the choices."""
    trainer = shared_trainer(equivalence_config(32, MODEL), ShardingPolicy(), num_devices=1)
    state = trainer.init_state()
    model = nnx.merge(trainer.graphdef, jax.device_get(state.params))
    batch = step_batch(trainer, 0)  # (1, 32, seq + 1)
    rows = jnp.asarray(jax.device_get(batch))[0]
    out = model.outputs(rows[:, :-1])
    want_aux = aux_loss(out.routing, out.routing.counts, out.routing.rows)
    _, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["aux_loss"], want_aux, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], next_token_loss(out.logits, rows[:, 1:]), rtol=1e-6)
    load = np.asarray(metrics["expert_load"])
    np.testing.assert_allclose(load, out.routing.counts / out.routing.counts.sum(), rtol=1e-6)
    assert load.shape == (4,) and abs(load.sum() - 1) < 1e-6


CASES = [  # (policy, microbatches per step of 32 examples on 8 devices)
    (ShardingPolicy(tp=2, fsdp=True), 1),
    (ShardingPolicy(tp=2), 2),  # replicas accumulate on their own: the statistics cross them
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
    assert names["layers/mlp/gate_proj"] == ("n_layer", "n_expert", "n_expert_mlp", "n_embd")
    assert names["layers/mlp/gate/weight"] == ("n_layer", "n_expert", "n_embd")
    assert trainer.num_params == FAMILY.num_params(MODEL)
    assert "layers/mlp/down_proj" in trainer.per_layer_paths  # gathered one layer at a time
    experts = 2 * 4 * (40 * (1 + 3 * 16))  # two layers of four experts and their routers
    assert (
        FAMILY.num_params(MODEL)
        - FAMILY.num_params(MODEL.model_copy(update={"num_experts": 2, "num_experts_per_tok": 1}))
        == experts // 2
    )
    weights = FAMILY.matmuls(MODEL).layer_weights
    assert weights[4:] == ((40, 4), (40, 32), (40, 32), (32, 40))
