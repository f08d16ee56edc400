"""The Hugging Face reference of tests/test_hf.py and tests/test_lora_hf.py: tiny random
transformers models made here (no download), their float32 logits and greedy tokens.

torch, transformers and peft are imported on first use, so only the worker that runs the Hugging
Face group loads them (torch's threads would otherwise share every worker with XLA's device
threads). Without the reference extra (``pip install -c constraints.txt -e '.[hf-reference]'``)
those tests skip, except under CI (``CI`` set), where they fail.
"""

import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tokenizers


@functools.cache
def _imported() -> SimpleNamespace | None:
    try:
        import peft
        import safetensors.torch
        import torch
        import transformers
    except ImportError:
        if os.environ.get("CI"):
            raise
        return None
    torch.set_num_threads(1)  # tiny models; XLA's device threads keep the cores
    return SimpleNamespace(
        torch=torch,
        transformers=transformers,
        peft=peft,
        load_file=safetensors.torch.load_file,
        save_file=safetensors.torch.save_file,
    )


def libraries() -> SimpleNamespace:
    """torch, transformers, peft and safetensors' load_file/save_file; the calling test skips
    when they are not installed (and fails under CI)."""
    found = _imported()
    if found is None:
        pytest.skip(
            "needs the reference models: pip install -c constraints.txt -e '.[hf-reference]'"
        )
    return found


VOCAB = 256  # the built-in byte corpus trains on it; divides into 8 ZeRO partitions
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA31 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # below the test's positions: every band is scaled
}
GEMMA = dict(COMMON, head_dim=16, sliding_window=4, query_pre_attn_scalar=24)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}
# kind: (transformers config from the transformers module, config.json layout, saved dtype)
KINDS = {
    "llama": (lambda t: t.LlamaConfig(**COMMON), "5.x", "float32"),
    "llama31": (lambda t: t.LlamaConfig(**COMMON, rope_parameters=LLAMA31), "5.x", "float32"),
    "llama31-4.x": (lambda t: t.LlamaConfig(**COMMON, rope_parameters=LLAMA31), "4.x", "float32"),
    "qwen2": (lambda t: t.Qwen2Config(**COMMON, tie_word_embeddings=True), "4.x", None),
    "qwen3": (lambda t: t.Qwen3Config(**COMMON, head_dim=16), "5.x", "float32"),
    # Windows of 4 on sequences of 13: on every layer (Mistral), on layer 1 only (Qwen2).
    "mistral": (lambda t: t.MistralConfig(**COMMON, sliding_window=4), "5.x", "float32"),
    "qwen2-window": (
        lambda t: t.Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1
        ),
        "4.x",
        "float32",
    ),
    # OLMo 2: q/k norms as wide as all heads (n_q 64, n_kv 32), apart from hidden_size (48).
    "olmo2": (lambda t: t.Olmo2Config(**COMMON, head_dim=16, eos_token_id=None), "5.x", "float32"),
    # Gemma 2 (4.x layout: layers alternate, sliding first) and Gemma 3 text: windows of 4 on
    # sequences of 13, a sliding and a global layer, a head_dim (16) apart from the width (48) and
    # the attention scale (query_pre_attn_scalar 24); caps low enough to bite; Gemma 3's layers
    # rotate with their own bases, the global one linearly scaled.
    "gemma2": (
        lambda t: t.Gemma2Config(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        "4.x",
        "float32",
    ),
    "gemma3": (
        lambda t: t.Gemma3TextConfig(
            **GEMMA,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=GEMMA3_ROPE,
        ),
        "5.x",
        "float32",
    ),
    "gpt2": (
        lambda t: t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=2, n_head=4),
        "5.x",
        "float32",
    ),
    "llama-bf16": (lambda t: t.LlamaConfig(**COMMON), "5.x", "bfloat16"),
}
# Mixtures of experts (tests/test_moe_hf.py): 4 experts, 2 per token, each 24 wide (split 8 ways
# by tp=2 + FSDP on 8 devices), renormalised (Qwen3-MoE's norm_topk_prob).
QWEN3_MOE = dict(
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    router_aux_loss_coef=0.02,
)
MOE_KINDS = {
    "qwen3_moe": (lambda t: t.Qwen3MoeConfig(**COMMON, **QWEN3_MOE), "5.x", "float32"),
    # Qwen3-MoE with dense layers: every second layer has experts (decoder_sparse_step 2), and
    # layer 1 none (mlp_only_layers): 4 layers dense, dense, dense, experts; then 3 layers
    # dense, experts, dense (runs of one type each, scanned in turn).
    **{
        kind: (
            lambda t, layers=layers, only=only: t.Qwen3MoeConfig(
                **{**COMMON, "num_hidden_layers": layers},
                **QWEN3_MOE,
                decoder_sparse_step=2,
                mlp_only_layers=only,
            ),
            "5.x",
            "float32",
        )
        for kind, layers, only in (("qwen3_moe_dense_1", 4, [1]), ("qwen3_moe_sparse_2", 3, []))
    },
    # OLMoE: q/k norms over all heads, the chosen probabilities as they are (no renormalising).
    "olmoe": (
        lambda t: t.OlmoeConfig(
            **{**COMMON, "intermediate_size": 24},
            num_experts=4,
            num_experts_per_tok=2,
            eos_token_id=None,
            pad_token_id=None,
        ),
        "5.x",
        "float32",
    ),
    # Mixtral: windows of 4 on every layer (sequences of 13), w1/w3/w2 experts.
    "mixtral": (
        lambda t: t.MixtralConfig(
            **{**COMMON, "intermediate_size": 24},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        ),
        "5.x",
        "float32",
    ),
}
IDS = np.random.RandomState(0).randint(0, VOCAB, (3, 13))


def to_4x_layout(config_file: Path) -> None:
    """Rewrite a transformers 5.x config.json as 4.x wrote it: top-level rope_theta and
    rope_scaling (None for plain rotary), no layer_types (Qwen2: max_window_layers says)."""
    config = json.loads(config_file.read_text())
    config.pop("layer_types", None)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config_file.write_text(json.dumps(config, indent=2))


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    torch = libraries().torch
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def saved_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """The float32 logits of ``ids`` under the transformers model saved in ``folder`` (an
    ``export-hf`` of a run, say)."""
    lib = libraries()
    model = lib.transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=lib.torch.float32)
    return reference_logits(model.eval(), ids)


def greedy_reference(model, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(reference_logits(model, np.array([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def byte_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level tokenizer of 256 ids (no merges), as a model folder would ship one."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model = tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, [])
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


class Reference:
    """A saved transformers model and its float32 logits of IDS."""

    def __init__(self, kind: str, directory: Path):
        lib = libraries()
        torch, transformers = lib.torch, lib.transformers
        make_config, layout, dtype = {**KINDS, **MOE_KINDS}[kind]
        torch.manual_seed(len(kind))
        model = transformers.AutoModelForCausalLM.from_config(make_config(transformers)).eval()
        with torch.no_grad():
            for param in model.parameters():  # so that unit norms and zero biases matter too
                param.normal_(0.0, 0.2)
        if dtype is not None:
            model = model.to(getattr(torch, dtype))
        self.directory = directory
        model.save_pretrained(directory)
        if layout == "4.x":
            to_4x_layout(directory / "config.json")
        byte_tokenizer().save(str(directory / "tokenizer.json"))
        # What is on disk, in float32 (a model converted to bfloat16 and back in memory would keep
        # its bfloat16-rounded rotary frequencies).
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32
        ).eval()
        self.logits = reference_logits(self.model, IDS)
