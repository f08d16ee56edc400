"""The Llama-family model under the family's policies (tests/support.py): the numbers of one
device; its plan, parameter count, FLOPs and the planner's view of Llama 3.1 8B."""

import json

import pytest
from support import (
    EQUIVALENCE_LLAMA,
    FAMILY_POLICIES,
    LLAMA31_8B_CONFIG,
    LLAMA_FAMILY,
    GPTTrainer,
    GPTTrainerConfig,
    LlamaTrainer,
    LlamaTrainerConfig,
    assert_same_numbers,
    equivalence_config,
    invoke,
    one_device_run,
    policy_config,
    policy_id,
    run_steps,
    shared_trainer,
)

from theseus.config import apply_overrides
from theseus.sharding.axis import ShardingPolicy
from theseus.training.flops import xla_flops_per_token

MODEL = EQUIVALENCE_LLAMA


def config(per_device_batch_size: int):
    """The GPT equivalence test's settings (global batch 32, learning rate 1e-3, 3 steps)."""
    return equivalence_config(per_device_batch_size, MODEL)


@pytest.mark.parametrize("policy", FAMILY_POLICIES, ids=policy_id)
def test_policy_matches_one_device(policy):
    """Losses within 1e-5 relative over three steps and parameters within 1e-4 (the suite's
    tolerances), and the loss goes down, with 4 microbatches per step. (Accumulation is the
    trainer's, not the model's: GPT's matrix runs every policy, with accumulation 1 and 4, and
    also compares validation losses.)"""
    trainer = shared_trainer(policy_config(policy, 4, MODEL), policy)
    assert trainer.batch_plan.accumulation_steps == 4
    got = run_steps(trainer)
    assert got.step == 3
    assert_same_numbers(got, one_device_run(trainer.config))


def test_sliding_windows_match_one_device():
    """Windows of 4 on the last two of three layers (sequences of 24): tp=2 + FSDP, which gathers
    one layer at a time, gives one device's numbers."""
    model = MODEL.model_copy(
        update={
            "sliding_window": 4,
            "layer_types": ("full_attention",) + ("sliding_attention",) * 2,
        }
    )
    policy = ShardingPolicy(tp=2, fsdp=True)
    trainer = shared_trainer(policy_config(policy, 1, model), policy)
    assert trainer.seq_len == 24 and "layers/q_proj/weight" in trainer.per_layer_paths
    assert_same_numbers(run_steps(trainer), one_device_run(trainer.config))


def test_windows_export_as_transformers_reads_them():
    """Full then sliding layers export as qwen2 (with biases: max_window_layers and layer_types)
    and import back the same; without biases or q/k norms no type writes them: refused."""
    types = ("full_attention", "sliding_attention", "sliding_attention")
    windowed = MODEL.model_copy(
        update={"sliding_window": 4, "layer_types": types, "qk_norm": False}
    )
    model = windowed.model_dump(mode="json")
    hf_spec = LLAMA_FAMILY.hf
    assert hf_spec.export_type(model, None) == "qwen2"
    hf = hf_spec.to_hf(model, "qwen2") | {"num_attention_heads": 8}
    assert (hf["use_sliding_window"], hf["max_window_layers"]) == (True, 1)
    for config in (hf, {k: v for k, v in hf.items() if k != "layer_types"}):
        back = hf_spec.from_hf(config, "qwen2", "config.json")
        assert (back["sliding_window"], tuple(back["layer_types"])) == (4, types)
    with pytest.raises(ValueError, match="layer_types mixes sliding and full layers"):
        hf_spec.export_type(model | {"attention_bias": False}, "mistral")


def test_plan_names_and_counts():
    trainer = shared_trainer(config(4), ShardingPolicy(tp=2, fsdp=True))
    names = {leaf.path: leaf.names for leaf in trainer.abstract_leaves}
    assert names["layers/q_proj/weight"] == ("n_layer", "n_q", "n_embd")
    assert names["layers/k_proj/bias"] == ("n_layer", "n_kv")
    assert names["layers/down_proj/weight"] == ("n_layer", "n_embd", "n_mlp")
    assert names["layers/q_norm/weight"] == ("n_layer", None)
    assert trainer.num_params == LLAMA_FAMILY.num_params(MODEL)
    assert "layers/q_proj/weight" in trainer.per_layer_paths  # gathered one layer at a time
    untied = LLAMA_FAMILY.num_params(MODEL.model_copy(update={"tie_word_embeddings": True}))
    assert LLAMA_FAMILY.num_params(MODEL) - untied == 256 * 40


def test_analytic_flops_match_xla():
    trainer = shared_trainer(config(4), ShardingPolicy(), num_devices=1)
    analytic, xla = trainer.flops_per_token(), xla_flops_per_token(trainer)
    assert abs(analytic / xla - 1) < 0.1, (analytic, xla)


def test_plan_llama31_8b_on_64_devices(tmp_path):
    """The planner sizes Llama 3.1 8B (abstractly) on 64 devices, from model overrides and from
    its config.json (`--hf`, the file or its folder) with no model override: the same plan."""
    llama8b = [
        "model.vocab_size=128256", "model.hidden_size=4096", "model.intermediate_size=14336",
        "model.num_layers=32", "model.num_heads=32", "model.num_kv_heads=8",
        "model.max_position_embeddings=131072", "model.rope_theta=500000.0",
        "model.rope_type=llama3", "model.rms_norm_eps=1e-5", "model.head_dim=128",
    ]  # fmt: skip
    training = [
        "training.seq_len=8192", "training.batch_size=64", "training.dtype=bfloat16",
        "training.per_device_batch_size=1",
    ]  # fmt: skip
    flags = ("--devices", "64", "--tp", "8", "--fsdp", "--json")
    result = invoke("plan", "llama/train/pretrain", *flags, *llama8b, *training)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["num_params"] == 8_030_261_248  # Llama 3.1 8B's published count
    assert plan["mesh"] == {"batch": 8, "shard": 8}
    assert all(not row["problems"] for row in plan["rows"])
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B_CONFIG))
    for given in (tmp_path / "config.json", tmp_path):
        from_hf = invoke("plan", "--hf", given, *flags, *training)
        assert from_hf.exit_code == 0, from_hf.output
        assert json.loads(from_hf.output) == plan
    gpt = invoke("plan", "gpt/train/pretrain", "--hf", tmp_path, "--devices", "8")
    assert gpt.exit_code == 2
    assert "trains the gpt family, but the Hugging Face config is a llama model" in gpt.output


def test_sequences_longer_than_the_context_are_refused():
    """Both decoders refuse a training.seq_len beyond their context, naming the key to raise."""

    for trainer_class, config_class, key in (
        (GPTTrainer, GPTTrainerConfig, "model.block_size"),
        (LlamaTrainer, LlamaTrainerConfig, "model.max_position_embeddings"),
    ):
        config = apply_overrides(config_class(), [f"{key}=16", "training.seq_len=17"])
        with pytest.raises(ValueError, match=rf"seq_len=17 exceeds {key}=16; .* raise {key}\."):
            trainer_class(config, ShardingPolicy())
