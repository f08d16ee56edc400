"""Hugging Face ``config.json`` to a theseus job and model config, and back.

Reads both layouts transformers writes: 4.x (top-level ``rope_theta`` and ``rope_scaling``, which
most published checkpoints have) and 5.x (``rope_parameters``). Anything theseus's models cannot
reproduce exactly (another architecture, mixture of experts, another activation or rotary
scaling, MLP biases, Qwen2's sliding window in use) is refused with the key and the supported
values. Mistral's ``sliding_window`` is carried into the model config, where sequences longer than
it are refused (see :class:`theseus.model.llama.LlamaConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = (*LLAMA_TYPES, "gpt2")
LLAMA_JOB = "llama/train/pretrain"
GPT_JOB = "gpt/train/pretrain"
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelSpec:
    """What a Hugging Face config becomes: the theseus job, its ``model`` section and the
    Hugging Face model type it came from."""

    job: str
    model: dict[str, Any]
    model_type: str
    special_tokens: dict[str, Any]


def _fail(where: str, message: str) -> ValueError:
    return ValueError(f"{where}: {message}")


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Rotary settings from either config layout."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5.x
        scaling, theta = params, params["rope_theta"]
    else:  # transformers 4.x
        scaling, theta = hf.get("rope_scaling") or {}, hf.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise _fail(
            where,
            f"rotary scaling {rope_type!r} is not supported; theseus reproduces 'default' and "
            "'llama3' (Llama 3.1)",
        )
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "llama3":
        out |= {
            "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_position_embeddings": int(
                scaling["original_max_position_embeddings"]
            ),
        }
    return out


def _llama(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(where, f"hidden_act={act!r}; theseus's SwiGLU MLP uses 'silu'")
    if hf.get("mlp_bias"):
        raise _fail(where, "mlp_bias=true is not supported (no Llama-family release uses it)")
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        raise _fail(
            where, "use_sliding_window=true is not supported: theseus attends the full context"
        )
    heads = hf["num_attention_heads"]
    default_head_dim = 128 if model_type == "qwen3" else hf["hidden_size"] // heads
    bias = True if model_type == "qwen2" else bool(hf.get("attention_bias", False))
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or default_head_dim,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": bias,
        "qk_norm": model_type == "qwen3",
        # Mistral's window is carried, and sequences longer than it are refused (see LlamaConfig).
        "sliding_window": hf.get("sliding_window") if model_type == "mistral" else None,
        **_rope(hf, where),
    }


def _gpt2(hf: dict[str, Any], where: str) -> dict[str, Any]:
    n_embd = hf["n_embd"]
    n_inner = hf.get("n_inner") or 4 * n_embd
    checks = [
        (n_inner % n_embd == 0, f"n_inner={n_inner} is not a multiple of n_embd={n_embd}"),
        (
            hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
            f"activation_function={hf.get('activation_function')!r}; theseus's GPT uses tanh GELU",
        ),
        (
            float(hf.get("layer_norm_epsilon", 1e-5)) == 1e-5,
            f"layer_norm_epsilon={hf.get('layer_norm_epsilon')}; theseus's GPT uses 1e-5",
        ),
        (hf.get("scale_attn_weights", True), "scale_attn_weights=false is not supported"),
        (
            not hf.get("scale_attn_by_inverse_layer_idx") and not hf.get("reorder_and_upcast_attn"),
            "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise _fail(where, message)
    return {
        "vocab_size": hf["vocab_size"],
        "block_size": hf.get("n_positions", hf.get("n_ctx", 1024)),
        "n_layer": hf["n_layer"],
        "n_head": hf["n_head"],
        "n_embd": n_embd,
        "mlp_ratio": n_inner // n_embd,
        "dropout": 0.0,
    }


def model_spec(hf: dict[str, Any], where: str) -> ModelSpec:
    """The theseus job and model section of a Hugging Face config (``where`` names its file)."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    experts = [key for key in _EXPERT_KEYS if hf.get(key)]
    if model_type not in SUPPORTED or experts:
        what = f"model_type {model_type!r}" + (f" with experts ({experts[0]})" if experts else "")
        raise _fail(
            where,
            f"{what} (architectures {architectures}) is not supported; theseus imports "
            f"{', '.join(SUPPORTED)} (dense decoders)",
        )
    wanted = _ARCHITECTURES[model_type]
    if architectures and wanted not in architectures:
        raise _fail(
            where, f"architectures {architectures}: theseus imports {wanted} for {model_type}"
        )
    tokens = {key: hf[key] for key in SPECIAL_TOKENS if hf.get(key) is not None}
    try:
        if model_type == "gpt2":
            return ModelSpec(GPT_JOB, _gpt2(hf, where), model_type, tokens)
        return ModelSpec(LLAMA_JOB, _llama(hf, model_type, where), model_type, tokens)
    except KeyError as error:
        raise _fail(where, f"required key {error.args[0]!r} is missing") from None


def export_model_type(job: str, model: dict[str, Any], imported: str | None) -> str:
    """The Hugging Face model type a run exports as: the imported one when it can express the
    model, else the plainest that can (llama, qwen2 for biases, qwen3 for q/k norms)."""
    if job == GPT_JOB:
        return "gpt2"
    if model["qk_norm"]:
        return "qwen3"
    if imported == "qwen2" and model["attention_bias"]:
        return "qwen2"
    if imported == "mistral" and not model["attention_bias"]:
        return "mistral"
    return "llama"


def hf_config(job: str, model: dict[str, Any], model_type: str, dtype: str) -> dict[str, Any]:
    """A transformers 5.x ``config.json`` for a theseus model section."""
    base = {"architectures": [_ARCHITECTURES[model_type]], "model_type": model_type, "dtype": dtype}
    if model_type == "gpt2":
        return base | {
            "vocab_size": model["vocab_size"],
            "n_positions": model["block_size"],
            "n_embd": model["n_embd"],
            "n_layer": model["n_layer"],
            "n_head": model["n_head"],
            "n_inner": model["mlp_ratio"] * model["n_embd"],
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": True,
        }
    rope = {"rope_type": model["rope_type"], "rope_theta": model["rope_theta"]}
    if model["rope_type"] == "llama3":
        rope |= {
            "factor": model["rope_factor"],
            "low_freq_factor": model["rope_low_freq_factor"],
            "high_freq_factor": model["rope_high_freq_factor"],
            "original_max_position_embeddings": model["rope_original_max_position_embeddings"],
        }
    config = base | {
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model["head_dim"] or model["hidden_size"] // model["num_heads"],
        "max_position_embeddings": model["max_position_embeddings"],
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": model["tie_word_embeddings"],
        "hidden_act": "silu",
        "rope_parameters": rope,
    }
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = model["attention_bias"]
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    if model_type == "mistral":
        config["sliding_window"] = model.get("sliding_window")
    return config
