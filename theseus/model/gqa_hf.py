"""The Hugging Face ``config.json`` keys and checkpoint tensors every rotary grouped-query decoder
(Llama, OLMo 2, Gemma) shares; a family module adds its own keys and tensors."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from theseus.model.family import HFTensor, Stacks, whole


def check_key(hf: dict[str, Any], key: str, supported: Any, default: Any, where: str) -> None:
    """Refuse a ``config.json`` whose ``key`` (absent or null: ``default``) isn't ``supported``."""
    value = default if hf.get(key) is None else hf[key]
    if value != supported:
        raise ValueError(
            f"{where}: {key}={json.dumps(value)} is not supported; theseus reproduces "
            f"{key}={json.dumps(supported)} for this model type"
        )


def from_hf_common(hf: dict[str, Any], default_head_dim: int | None, default_eps: float) -> dict:
    """The model-section keys every rotary grouped-query ``config.json`` has (``head_dim``
    absent: ``default_head_dim``, else hidden_size / num_heads)."""
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or default_head_dim or hf["hidden_size"] // heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "rms_norm_eps": float(hf.get("rms_norm_eps", default_eps)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def to_hf_common(model: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` keys of :func:`from_hf_common`."""
    return {
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": widths(model)[0],
        "max_position_embeddings": model["max_position_embeddings"],
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": model["tie_word_embeddings"],
    }


def widths(model: dict[str, Any]) -> tuple[int, int, int]:
    """head_dim, n_q and n_kv of a model section."""
    head_dim = model["head_dim"] or model["hidden_size"] // model["num_heads"]
    return head_dim, model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim


def projection_shapes(model: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Hugging Face's (d_out, d_in) of each layer's attention and MLP projections."""
    e, mlp = model["hidden_size"], model["intermediate_size"]
    _, n_q, n_kv = widths(model)
    return {
        "self_attn.q_proj": (n_q, e),
        "self_attn.k_proj": (n_kv, e),
        "self_attn.v_proj": (n_kv, e),
        "self_attn.o_proj": (e, n_q),
        "mlp.gate_proj": (mlp, e),
        "mlp.up_proj": (mlp, e),
        "mlp.down_proj": (e, mlp),
    }


def checkpoint_tensors(
    model: dict[str, Any],
    layer_weights: dict[str, tuple[int, ...]],
    extra: Iterable[HFTensor] = (),
    stacks: Stacks | None = None,
) -> list[HFTensor]:
    """The checkpoint's tensors: the token table, each layer's ``layer_weights`` (module name
    under ``model.layers.N.`` to shape; theseus path ``<stack>/<last name>/weight``, the
    layer's stack in ``stacks``, default one: ``layers/``), ``extra`` tensors, the final norm
    and the untied head."""
    e, vocab = model["hidden_size"], model["vocab_size"]
    found = [whole("model.embed_tokens.weight", (vocab, e), "embed_tokens")]
    stacks = stacks or Stacks((True,) * model["num_layers"])
    found.extend(layer_tensors(layer_weights, stacks, range(model["num_layers"])))
    found.extend(extra)
    found.append(whole("model.norm.weight", (e,), "norm/weight"))
    if not model["tie_word_embeddings"]:
        found.append(whole("lm_head.weight", (vocab, e), "lm_head"))
    return found


def layer_tensors(
    layer_weights: Mapping[str, tuple[int, ...]], stacks: Stacks, layers: Iterable[int]
) -> list[HFTensor]:
    """The ``layer_weights`` (module name under ``model.layers.N.`` to shape) of each of
    ``layers``, each at ``<its stack>/<last name>/weight``."""
    found = []
    for layer in layers:
        stack, index = stacks.place(layer)
        for module, shape in layer_weights.items():
            path = f"{stack}/{module.split('.')[-1]}/weight"
            found.append(whole(f"model.layers.{layer}.{module}.weight", shape, path, index))
    return found
