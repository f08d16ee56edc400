"""The Qwen3-MoE family: Qwen3-30B-A3B, Qwen3-235B-A22B and their kind (``model_type``
``qwen3_moe``).

Qwen3's attention (per-head q/k RMSNorm, rotary, grouped-query heads, a window on every layer
when ``use_sliding_window``) with an expert block in place of the MLP: a softmax router over
``num_experts`` experts, the ``num_experts_per_tok`` best, renormalised when ``norm_topk_prob``,
each a SwiGLU MLP ``moe_intermediate_size`` wide (:mod:`theseus.model.experts`). Training adds
``router_aux_loss_coef`` times the load-balancing loss. Weights are stored as Hugging Face stores
them, ``(d_out, d_in)``, stacked along ``n_layer`` (and ``n_expert``), so checkpoints import and
export without permuting anything. Layer ``i`` has experts unless it is one of
``mlp_only_layers`` or ``i + 1`` is not a multiple of ``decoder_sparse_step`` (transformers'
rule); the others have a gated MLP ``intermediate_size`` wide (:class:`DenseLayer`). A model whose
layers mix the two holds them in runs of consecutive layers of one type, each stacked and scanned
on its own (:class:`~theseus.model.decoder.Runs`, parameters under ``layers/runs/<run>/``); every
published checkpoint has experts in every layer, one stack under ``layers/``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx
from jax.typing import DTypeLike

from theseus.model import gqa, gqa_hf, moe
from theseus.model.decoder import LayerInputs, LayerOutput, PerLayer, stack_runs
from theseus.model.experts import Experts
from theseus.model.family import HFSpec, HFTensor, Stacks
from theseus.model.gqa import field
from theseus.model.moe import MoEConfig, MoESettings
from theseus.model.parts import RMSNorm, weights
from theseus.model.rotary import rope_from_hf, rope_to_hf


class Qwen3MoeConfig(MoEConfig):
    """Hyperparameters of a Qwen3-MoE decoder (the names of Hugging Face's config). A window
    (``sliding_window``) applies to every layer; ``head_dim`` None means hidden_size /
    num_heads. ``decoder_sparse_step`` and ``mlp_only_layers`` say which layers have experts
    (Hugging Face's rule, :attr:`stacks`); the others have a gated MLP ``intermediate_size``
    wide."""

    norm_topk_prob: bool = field(False, "renormalise the chosen experts' weights to sum to 1")
    decoder_sparse_step: pydantic.StrictInt = field(1, "every k-th layer has experts", ge=1)
    mlp_only_layers: tuple[pydantic.StrictInt, ...] = field(
        (), "layers with a dense MLP instead of experts"
    )

    @property
    def stacks(self) -> Stacks:
        """Layer ``i`` has experts unless in ``mlp_only_layers`` or ``(i + 1) %
        decoder_sparse_step != 0`` (transformers' Qwen3MoeDecoderLayer)."""
        step, dense = self.decoder_sparse_step, set(self.mlp_only_layers)
        return Stacks(tuple(i not in dense and (i + 1) % step == 0 for i in range(self.num_layers)))

    @pydantic.model_validator(mode="after")
    def _some_layer_has_experts(self) -> Qwen3MoeConfig:
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(
                f"Qwen3MoeConfig.mlp_only_layers={list(self.mlp_only_layers)} names layers "
                f"{outside} outside 0..{self.num_layers - 1} (num_layers={self.num_layers}); "
                "list only layers the model has."
            )
        if not any(self.stacks.kinds):
            raise ValueError(
                f"Qwen3MoeConfig: no layer has experts (num_layers={self.num_layers}, "
                f"decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                f"{list(self.mlp_only_layers)}); a model without experts is a dense Qwen3: "
                "lower decoder_sparse_step or list fewer mlp_only_layers."
            )
        return self


@weights
class Layer(gqa.Attention):
    """A Qwen3-MoE layer's weights: attention with per-head q/k norms, the two norms, the
    expert block ``mlp``."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp: Experts


@weights
class DenseLayer(gqa.Attention, gqa.MLP):
    """A Qwen3-MoE layer without experts (``mlp_only_layers``, ``decoder_sparse_step``): as
    :class:`Layer`, with a gated MLP in place of the expert block (a Qwen3 layer)."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm


def block(
    layer: Layer | DenseLayer, x: jax.Array, inputs: LayerInputs, s: MoESettings
) -> LayerOutput:
    """One pre-RMSNorm layer on the float32 stream ``x`` (batch, seq, n_embd): attention with
    per-head q/k norms and rotary q/k, then the expert block, whose routing goes out with it
    (a :class:`DenseLayer`: its gated MLP, no routing)."""
    h = layer.input_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
    attended = gqa.self_attention(layer, h, inputs, inputs.features, s.head_dim)
    x = x + attended.output.astype(jnp.float32)
    if isinstance(layer, DenseLayer):
        h = layer.post_attention_layernorm(x, s.compute_dtype)  # (batch, seq, n_embd)
        out = gqa.gated_mlp(layer, h, jax.nn.silu)  # (batch, seq, n_embd)
        return LayerOutput(x + out.astype(jnp.float32), attended.cache)
    x, routing = moe.expert_sublayer(layer, x, s)
    return LayerOutput(x, attended.cache, routing)


def skeleton(c: Qwen3MoeConfig, compute_dtype: DTypeLike, remat: bool | str = False):
    sk = gqa.rotary_skeleton(c, compute_dtype, remat, layer=block)
    return moe.routed(replace(sk, per_layer=PerLayer(windows=c.windows)), c)


class Qwen3Moe(gqa.Model):
    """A Qwen3-MoE decoder (see the module docstring). State paths are Hugging Face's names,
    layers stacked: ``embed_tokens``, ``norm/weight``, ``lm_head`` unless tied; under
    ``layers/``: the norms, ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
    ``k_norm`` and the expert block ``mlp`` (``gate/weight`` the router, ``gate_proj``,
    ``up_proj``, ``down_proj`` (n_layer, n_expert, ...)); a :class:`DenseLayer` has
    ``gate_proj``, ``up_proj`` and ``down_proj`` in place of ``mlp``. Layers of both types:
    ``layers/runs/<run>/`` in place of ``layers/``."""

    skeleton_of = staticmethod(skeleton)

    def build(self, c: Qwen3MoeConfig, rngs: nnx.Rngs) -> None:
        self.embed_tokens = gqa.token_table(c, rngs)
        runs = [layer_run(c, experts, length, rngs) for experts, length in c.stacks.runs]
        self.layers = stack_runs(runs)
        gqa.add_head(self, c, rngs)


def layer_run(c: Qwen3MoeConfig, experts: bool, length: int, rngs: nnx.Rngs) -> Layer | DenseLayer:
    """``length`` consecutive layers, stacked: :class:`Layer` when they have ``experts``, else
    :class:`DenseLayer`."""
    run = c.model_copy(update={"num_layers": length})  # the builders stack num_layers layers
    rms = gqa.rms_norms(run, rngs)
    attention = {
        "input_layernorm": rms(c.hidden_size),
        **gqa.attention_projections(run, rngs, head_norm=rms),
        "post_attention_layernorm": rms(c.hidden_size),
    }
    if experts:
        return Layer(**attention, mlp=moe.expert_block(run, c.norm_topk_prob, rngs))
    return DenseLayer(**attention, **gqa.mlp_projections(run, rngs))


def num_params(c: Qwen3MoeConfig) -> int:
    """The exact number of parameters of ``Qwen3Moe(c)``."""
    attention = moe.attention_params(c, 2 * c.dim_per_head)  # per-head q/k norms
    return c.num_layers * attention + moe.expert_params(c) + c.table_params


# --- Hugging Face: Qwen3MoeForCausalLM ---------------------------------------------------------


def from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The model section of a Qwen3-MoE ``config.json``."""
    del model_type
    gqa_hf.check_key(hf, "hidden_act", "silu", "silu", where)
    gqa_hf.check_key(hf, "attention_bias", False, False, where)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return {
        **gqa_hf.from_hf_common(hf, 128, 1e-6),
        **moe.from_hf(hf),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": hf.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
        "sliding_window": window,
        **rope_from_hf(hf, where),
    }


def to_hf(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    del model_type
    window = model.get("sliding_window")
    return gqa_hf.to_hf_common(model) | moe.to_hf(model) | {
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(model),
        "attention_bias": False,
        "norm_topk_prob": model["norm_topk_prob"],
        "decoder_sparse_step": model["decoder_sparse_step"],
        "mlp_only_layers": list(model["mlp_only_layers"]),
        "use_sliding_window": window is not None,
        "sliding_window": window,
    }  # fmt: skip


def stacks(model: dict[str, Any]) -> Stacks:
    """Which layers of a model section have experts, and so how they are stacked."""
    return Qwen3MoeConfig.model_validate(model).stacks


def tensors(model: dict[str, Any], experts: list[HFTensor]) -> list[HFTensor]:
    """The checkpoint's tensors around the ``experts``' (one layout of :mod:`~theseus.model.moe`):
    every layer's attention and norms, the dense layers' gated MLPs."""
    head_dim, layers = gqa_hf.widths(model)[0], stacks(model)
    norms = {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}  # per head
    mlp = {k: v for k, v in gqa_hf.projection_shapes(model).items() if k.startswith("mlp.")}
    dense = gqa_hf.layer_tensors(mlp, layers, layers.layers(False))
    return gqa_hf.checkpoint_tensors(
        model, moe.layer_shapes(model) | norms, [*experts, *dense], layers
    )


FAMILY = moe.family(
    name="qwen3_moe",
    config_class=Qwen3MoeConfig,
    model_class=Qwen3Moe,
    num_params=num_params,
    hf=HFSpec(
        architectures={"qwen3_moe": "Qwen3MoeForCausalLM"},
        from_hf=from_hf,
        export_type=lambda model, imported: "qwen3_moe",
        to_hf=to_hf,
        **moe.tensor_layouts(tensors, stacks=stacks),
    ),
    descriptions={
        "train/pretrain": "train a Qwen3-MoE decoder (mixture of experts) on byte or token data",
        "evaluate": "validation loss of the latest Qwen3-MoE checkpoint of a run",
    },
)
