"""The OLMo 2 family: the family's policies (tests/support.py) with accumulation equal one
device; its plan's names, its exact parameter count (OLMo 2 7B's on 64 devices) and its FLOPs
against XLA's count. (Its logits, export and generation against transformers: tests/test_hf.py,
kind ``olmo2``.)"""

import json

import pytest
from support import (
    EQUIVALENCE_LLAMA,
    FAMILIES,
    FAMILY_POLICIES,
    assert_flops_match_xla,
    assert_same_numbers,
    equivalence_config,
    invoke,
    one_device_run,
    plan_on_64_devices,
    policy_config,
    policy_id,
    run_steps,
    shared_trainer,
)

from theseus.sharding.axis import ShardingPolicy

OLMO2_FAMILY = FAMILIES["olmo2"].family
# The Llama equivalence model's shapes (GQA 8/2, head_dim 8 apart from hidden_size / num_heads,
# Llama 3.1 rotary scaling, untied head): q/k norms 64 and 16 wide. Widths divide by 8.
MODEL = OLMO2_FAMILY.config_class(
    **EQUIVALENCE_LLAMA.model_dump(include=set(OLMO2_FAMILY.config_class.model_fields))
)


@pytest.mark.parametrize("policy", FAMILY_POLICIES, ids=policy_id)
def test_policy_matches_one_device(policy):
    """The family's policies: losses within 1e-5 relative over three steps, parameters within 1e-4 (the suite's
    tolerances), 4 microbatches a step; the q/k norms' statistics sum over the TP split."""
    trainer = shared_trainer(policy_config(policy, 4, MODEL), policy)
    assert trainer.batch_plan.accumulation_steps == 4
    assert_same_numbers(run_steps(trainer), one_device_run(trainer.config))


def test_plan_names_counts_and_flops():
    trainer = shared_trainer(equivalence_config(4, MODEL), ShardingPolicy(tp=2, fsdp=True))
    names = {leaf.path: leaf.names for leaf in trainer.abstract_leaves}
    assert names["layers/q_proj/weight"] == ("n_layer", "n_q", "n_embd")
    assert names["layers/q_norm/weight"] == ("n_layer", "n_q")
    assert names["layers/k_norm/weight"] == ("n_layer", "n_kv")
    assert names["layers/post_feedforward_layernorm/weight"] == ("n_layer", None)
    assert "layers/input_layernorm/weight" not in names  # no pre-norm
    assert trainer.num_params == OLMO2_FAMILY.num_params(MODEL)
    assert "layers/q_norm/weight" in trainer.per_layer_paths  # gathered one layer at a time
    assert_flops_match_xla(MODEL)


OLMO2_7B = {
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "vocab_size": 100352,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rope_theta": 500000,
    "rope_scaling": None,
    "rms_norm_eps": 1e-06,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_plan_olmo2_7b_on_64_devices(tmp_path):
    """The planner sizes OLMo 2 7B (allenai/OLMo-2-1124-7B's config.json, 4.x layout)
    abstractly on 64 devices: 7,298,617,344 parameters (transformers' count for that config),
    and no problems."""
    plan = plan_on_64_devices(tmp_path, OLMO2_7B, 4096)
    assert plan["num_params"] == 7_298_617_344


def test_an_unsupported_olmo2_setting_names_the_key(tmp_path):
    """attention_bias=true (biases on all four attention projections, in no OLMo 2 release):
    exit 2, one paragraph naming the key and the file."""
    (tmp_path / "config.json").write_text(json.dumps(OLMO2_7B | {"attention_bias": True}))
    result = invoke("plan", "--hf", tmp_path, "--devices", "8")
    assert result.exit_code == 2, result.output
    assert "attention_bias=true is not supported" in result.output
    assert str(tmp_path / "config.json") in result.output and "Traceback" not in result.output
