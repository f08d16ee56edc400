"""Which Hugging Face tensor holds which part of which theseus parameter.

Each Hugging Face tensor is described once (:class:`HFTensor`): its name, shape, and the
theseus parameters its last dimension is made of (one, or GPT-2's ``c_attn``: q, k and v side by
side). Import reads the parts of a theseus parameter from the tensors; export writes each tensor
from its parts. Llama-family weights are stored in theseus as Hugging Face stores them (``(d_out,
d_in)``, layers stacked), and GPT-2's Conv1D weights are ``(d_in, d_out)`` as theseus's GPT keeps
its kernels, so no tensor is ever transposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from theseus.hf.config import GPT_JOB


@dataclass(frozen=True)
class Part:
    """Columns ``[start, stop)`` of the tensor's last dimension are theseus parameter ``path``
    (its layer ``layer`` when the parameter is stacked along ``n_layer``)."""

    path: str
    layer: int | None
    start: int
    stop: int


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]


def _whole(name: str, shape: tuple[int, ...], path: str, layer: int | None = None) -> HFTensor:
    return HFTensor(name, shape, (Part(path, layer, 0, shape[-1]),))


def llama_tensors(model: dict[str, Any]) -> list[HFTensor]:
    """The tensors of a Llama-family checkpoint for a theseus ``model`` section."""
    e, mlp = model["hidden_size"], model["intermediate_size"]
    head_dim = model["head_dim"] or e // model["num_heads"]
    n_q, n_kv = model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim
    vocab = model["vocab_size"]
    tensors = [_whole("model.embed_tokens.weight", (vocab, e), "embed_tokens")]
    for layer in range(model["num_layers"]):
        prefix = f"model.layers.{layer}."
        shapes = {
            "input_layernorm": (e,),
            "self_attn.q_proj": (n_q, e),
            "self_attn.k_proj": (n_kv, e),
            "self_attn.v_proj": (n_kv, e),
            "self_attn.o_proj": (e, n_q),
            "post_attention_layernorm": (e,),
            "mlp.gate_proj": (mlp, e),
            "mlp.up_proj": (mlp, e),
            "mlp.down_proj": (e, mlp),
        }
        if model["qk_norm"]:
            shapes |= {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}
        for module, shape in shapes.items():
            path = f"layers/{module.split('.')[-1]}"
            tensors.append(_whole(f"{prefix}{module}.weight", shape, f"{path}/weight", layer))
        if model["attention_bias"]:
            for x, width in (("q", n_q), ("k", n_kv), ("v", n_kv)):
                name = f"{prefix}self_attn.{x}_proj.bias"
                tensors.append(_whole(name, (width,), f"layers/{x}_proj/bias", layer))
    tensors.append(_whole("model.norm.weight", (e,), "norm/weight"))
    if not model["tie_word_embeddings"]:
        tensors.append(_whole("lm_head.weight", (vocab, e), "lm_head"))
    return tensors


def gpt2_tensors(model: dict[str, Any]) -> list[HFTensor]:
    """The tensors of a GPT-2 checkpoint (``GPT2LMHeadModel``: ``transformer.`` names, head
    tied) for theseus's GPT ``model`` section."""
    e, vocab = model["n_embd"], model["vocab_size"]
    inner = model["mlp_ratio"] * e
    tensors = [
        _whole("transformer.wte.weight", (vocab, e), "wte"),
        _whole("transformer.wpe.weight", (model["block_size"], e), "wpe"),
    ]
    for layer in range(model["n_layer"]):
        prefix = f"transformer.h.{layer}."
        for hf, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
            for hf_leaf, leaf in (("weight", "scale"), ("bias", "bias")):
                name = f"{prefix}{hf}.{hf_leaf}"
                tensors.append(_whole(name, (e,), f"blocks/{ours}/{leaf}", layer))
        for leaf, shape in (("weight", (e, 3 * e)), ("bias", (3 * e,))):
            ours = "kernel" if leaf == "weight" else "bias"
            parts = tuple(
                Part(f"blocks/attn_{x}/{ours}", layer, i * e, (i + 1) * e)
                for i, x in enumerate("qkv")
            )
            tensors.append(HFTensor(f"{prefix}attn.c_attn.{leaf}", shape, parts))
        for hf, ours, d_in, d_out in (
            ("attn.c_proj", "attn_out", e, e),
            ("mlp.c_fc", "mlp_fc", e, inner),
            ("mlp.c_proj", "mlp_proj", inner, e),
        ):
            weight = f"{prefix}{hf}.weight"
            tensors.append(_whole(weight, (d_in, d_out), f"blocks/{ours}/kernel", layer))
            tensors.append(_whole(f"{prefix}{hf}.bias", (d_out,), f"blocks/{ours}/bias", layer))
    tensors.append(_whole("transformer.ln_f.weight", (e,), "ln_f/scale"))
    tensors.append(_whole("transformer.ln_f.bias", (e,), "ln_f/bias"))
    return tensors


def hf_tensors(job: str, model: dict[str, Any]) -> list[HFTensor]:
    """The Hugging Face tensors of a theseus model (its job and ``model`` section as JSON)."""
    return gpt2_tensors(model) if job == GPT_JOB else llama_tensors(model)


def aliases(name: str) -> tuple[str, ...]:
    """Names a tensor may have in published checkpoints: GPT-2's original files have no
    ``transformer.`` prefix."""
    return (name, name.removeprefix("transformer.")) if name.startswith("transformer.") else (name,)
