"""The Llama-family model under every policy: the numbers of one device; its plan, parameter count,
FLOPs and the planner's view of Llama 3.1 8B."""

import functools
import json

import jax
import numpy as np
import pytest
from support import EQUIVALENCE_BATCH, invoke
from test_trainer import POLICIES, batches

from theseus.config import apply_overrides
from theseus.model.llama import LlamaConfig, num_params
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.flops import xla_flops_per_token
from theseus.training.llama import LlamaTrainer, LlamaTrainerConfig

# Every feature on: GQA (8 query heads, 2 key/value heads), a head_dim (8) apart from
# hidden_size / num_heads (5), q/k/v biases, q/k norms, Llama 3.1 rotary scaling, untied head.
# The q, k/v and MLP widths (64, 16, 48) and the vocabulary divide by 8 (tp=8, ZeRO over 8).
MODEL = LlamaConfig(
    vocab_size=256,
    hidden_size=40,
    intermediate_size=48,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=24,
    rope_type="llama3",
    rope_original_max_position_embeddings=8,
    attention_bias=True,
    qk_norm=True,
)


def config(per_device_batch_size: int, model: LlamaConfig = MODEL) -> LlamaTrainerConfig:
    """The GPT equivalence test's settings (global batch 32, learning rate 1e-3, 3 steps)."""
    overrides = {
        "training.batch_size": EQUIVALENCE_BATCH,
        "training.per_device_batch_size": per_device_batch_size,
        "training.steps": 100,
        "optimization.learning_rate": 1e-3,
        "optimization.warmup_steps": 1,
    }
    return apply_overrides(
        LlamaTrainerConfig(model=model), [f"{k}={v}" for k, v in overrides.items()]
    )


def run(trainer: LlamaTrainer):
    """Three steps: per-step losses, final parameters on the host, the step counter. (GPT's
    equivalence test also compares validation losses; the step here is the costly compile.)"""
    state = trainer.init_state()
    losses = []
    for batch in batches(trainer):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params), int(state.step)


@functools.cache
def reference():
    one_device = Topology.new(ShardingPolicy(), devices=jax.devices()[:1])
    trainer = LlamaTrainer(config(EQUIVALENCE_BATCH), ShardingPolicy(), one_device)
    losses, params, _ = run(trainer)
    return losses, params


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"tp{p.tp}-zero{p.zero}-fsdp{p.fsdp}")
def test_policy_matches_one_device(policy, accumulation):
    """Losses within 1e-5 relative over three steps and parameters within 1e-4 (the suite's
    tolerances), and the loss goes down."""
    replicas = 8 // policy.tp
    trainer = LlamaTrainer(config(EQUIVALENCE_BATCH // (replicas * accumulation)), policy)
    assert trainer.batch_plan.accumulation_steps == accumulation
    losses, params, step = run(trainer)
    assert step == 3
    ref_losses, ref_params = reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=str(path))


def test_plan_names_and_counts():
    trainer = LlamaTrainer(config(4), ShardingPolicy(tp=2, fsdp=True))
    names = {leaf.path: leaf.names for leaf in trainer.abstract_leaves}
    assert names["layers/q_proj/weight"] == ("n_layer", "n_q", "n_embd")
    assert names["layers/k_proj/bias"] == ("n_layer", "n_kv")
    assert names["layers/down_proj/weight"] == ("n_layer", "n_embd", "n_mlp")
    assert names["layers/q_norm/weight"] == ("n_layer", None)
    assert trainer.num_params == num_params(MODEL)
    assert "layers/q_proj/weight" in trainer.per_layer_paths  # gathered one layer at a time
    untied = num_params(MODEL.model_copy(update={"tie_word_embeddings": True}))
    assert num_params(MODEL) - untied == 256 * 40


def test_analytic_flops_match_xla():
    trainer = LlamaTrainer(
        config(4), ShardingPolicy(), Topology.new(ShardingPolicy(), jax.devices()[:1])
    )
    analytic, xla = trainer.flops_per_token(), xla_flops_per_token(trainer)
    assert abs(analytic / xla - 1) < 0.1, (analytic, xla)


def test_plan_llama31_8b_on_64_devices():
    """The planner sizes Llama 3.1 8B (abstractly) on 64 devices."""
    llama8b = [
        "model.vocab_size=128256", "model.hidden_size=4096", "model.intermediate_size=14336",
        "model.num_layers=32", "model.num_heads=32", "model.num_kv_heads=8",
        "model.max_position_embeddings=131072", "model.rope_theta=500000.0",
        "model.rope_type=llama3", "training.seq_len=8192", "training.batch_size=64",
        "training.dtype=bfloat16", "training.per_device_batch_size=1",
    ]  # fmt: skip
    result = invoke(
        "plan", "llama/train/pretrain", "--devices", "64", "--tp", "8", "--fsdp", "--json",
        *llama8b,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["num_params"] == 8_030_261_248  # Llama 3.1 8B's published count
    assert plan["mesh"] == {"batch": 8, "shard": 8}
    assert all(not row["problems"] for row in plan["rows"])


def test_sequences_longer_than_the_context_are_refused():
    """Both decoders refuse a training.seq_len beyond their context, naming the key to raise."""
    from theseus.training.gpt import GPTTrainer, GPTTrainerConfig

    for trainer_class, config_class, key in (
        (GPTTrainer, GPTTrainerConfig, "model.block_size"),
        (LlamaTrainer, LlamaTrainerConfig, "model.max_position_embeddings"),
    ):
        config = apply_overrides(config_class(), [f"{key}=16", "training.seq_len=17"])
        with pytest.raises(ValueError, match=rf"seq_len=17 exceeds {key}=16; .* raise {key}\."):
            trainer_class(config, ShardingPolicy())
