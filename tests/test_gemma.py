"""The Gemma family: its policies with accumulation, and the recompute policies, equal one device
and its matrices gathered in bfloat16 (sliding and global layers with their own rotary bases,
soft-capping, q/k norms); its plan's names, its exact parameter count (Gemma 2 9B's on 64
devices) and its FLOPs against XLA's count; unsupported settings named. (Its logits, export and
generation against transformers: tests/test_hf.py, kinds ``gemma2`` and ``gemma3``.)"""

import json

import pytest
from support import (
    EQUIVALENCE_LLAMA,
    FAMILIES,
    assert_compute_dtype_gathers,
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

GEMMA_FAMILY = FAMILIES["gemma"].family
GemmaConfig = GEMMA_FAMILY.config_class
# The Llama equivalence model's shapes (GQA 8/2, head_dim 8 apart from hidden_size / num_heads)
# with every Gemma feature on: windows of 4 on layers 0 and 2 of 3 (sequences of 24), a local
# rotary base, Llama 3.1 scaling on the global layer, both soft caps, q/k norms, a tied head.
MODEL = GemmaConfig(
    **EQUIVALENCE_LLAMA.model_dump(include=set(GemmaConfig.model_fields))
    | dict(
        tie_word_embeddings=True,
        query_pre_attn_scalar=10,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,
        qk_norm=True,
        rope_local_base_freq=100.0,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    )
)


# The family matrix's tp=2 + FSDP case (tests/support.py), with the dots recompute policy, and
# the full one (a layer's window and rotary frequencies are recomputed with it) with FSDP alone.
# The matrix's tp=4 case (each key/value head on two devices) runs the attention's shared
# grouped-query code, which Gemma changes in nothing the layout sees (its soft-capping and q/k
# norms are per head): Llama's and OLMo 2's tp=4 cases hold it (tests/test_llama.py,
# tests/test_olmo2.py; OLMo 2's norms span the heads).
GEMMA_POLICIES = [
    ShardingPolicy(tp=2, fsdp=True, activation_checkpointing="dots"),
    ShardingPolicy(fsdp=True, activation_checkpointing="full"),
]


@pytest.mark.parametrize("policy", GEMMA_POLICIES, ids=policy_id)
def test_policy_matches_one_device(policy):
    """The family's policies: losses within 1e-5 relative over three steps, parameters within 1e-4 (the suite's
    tolerances), 4 microbatches a step; each layer's window and rotary frequencies travel through
    the layer scan that FSDP gathers one layer at a time."""
    trainer = shared_trainer(policy_config(policy, 4, MODEL), policy)
    assert trainer.batch_plan.accumulation_steps == 4 and trainer.seq_len == 24
    assert_same_numbers(run_steps(trainer), one_device_run(trainer.config))


def test_gathers_in_the_compute_dtype():
    """(1 + weight) norms read in float32 beside matrices read in bfloat16: under FSDP the
    matrices travel as 16-bit patterns; the tied embedding (read by index, in float32) is not
    cast. (Narrow gathers give the numbers of float32 ones: tests/test_gather_dtype.py.)"""
    assert_compute_dtype_gathers(MODEL, set())


def test_plan_names_counts_and_flops():
    trainer = shared_trainer(equivalence_config(4, MODEL), ShardingPolicy(tp=2, fsdp=True))
    names = {leaf.path: leaf.names for leaf in trainer.abstract_leaves}
    assert names["layers/q_proj/weight"] == ("n_layer", "n_q", "n_embd")
    assert names["layers/pre_feedforward_layernorm/weight"] == ("n_layer", None)
    assert names["layers/q_norm/weight"] == ("n_layer", None)
    assert "lm_head" not in names  # tied
    assert trainer.num_params == GEMMA_FAMILY.num_params(MODEL)
    assert "layers/q_proj/weight" in trainer.per_layer_paths  # gathered one layer at a time
    assert_flops_match_xla(MODEL)


# google/gemma-2-9b's config.json (transformers 4.42 wrote it).
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "torch_dtype": "float32",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 256000,
}


def test_plan_gemma2_9b_on_64_devices(tmp_path):
    """The planner sizes Gemma 2 9B abstractly on 64 devices: 9,241,705,984 parameters (42
    layers of 198,195,200, the tied table of 917,504,000 and the final norm's 3,584), its 21
    sliding layers among them, and no problems."""
    plan = plan_on_64_devices(tmp_path, GEMMA2_9B, 8192)
    assert plan["num_params"] == 9_241_705_984


# google/gemma-3-4b-pt's config.json (transformers 4.50), its vision_config left out: a text_config
# that leaves most keys to transformers' defaults, linear rotary scaling on the global layers.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "eos_token_id": [1, 106], "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    },
}  # fmt: skip


def test_plan_of_a_gemma3_folder_reads_its_text_config(tmp_path):
    """Gemma 3 4B's language model: 3,880,263,168 parameters (34 layers of 94,382,592, the tied
    table of 262,208 × 2,560 and the final norm), read from the folder's sparse text_config."""
    plan = plan_on_64_devices(tmp_path, GEMMA3_4B, 8192)
    assert plan["num_params"] == 3_880_263_168


GEMMA3_TEXT = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
    "hidden_size": 48, "intermediate_size": 56, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
}  # fmt: skip
BAD = {
    "rope": (
        {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}},
        "rope_type='yarn' is not supported",
    ),
    "bidirectional": (
        {"use_bidirectional_attention": True},
        "use_bidirectional_attention=true is not supported",
    ),
    "activation": ({"hidden_activation": "gelu"}, 'hidden_activation="gelu" is not supported'),
}


@pytest.mark.parametrize("case", BAD)
def test_an_unsupported_gemma_setting_names_the_key(case, tmp_path):
    """import-hf of a Gemma 3 config theseus cannot reproduce: exit 2, one paragraph naming the
    key and the file, nothing written."""
    change, expected = BAD[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(GEMMA3_TEXT | change))
    result = invoke("import-hf", tmp_path / "hf", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert expected in result.output and str(tmp_path / "hf" / "config.json") in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
