"""LoRA adapters in and for the Hugging Face world: the ``peft`` files of a LoRA run
(``adapter_config.json`` + ``adapter_model.safetensors``) and the merged weights of a run.

theseus keeps Llama-family weights in Hugging Face's ``(d_out, d_in)`` layout and their adapters
in that layout too (:mod:`theseus.model.lora`): ``lora_a`` of one layer is peft's
``lora_A.weight`` ``(r, d_in)`` and ``lora_b`` its ``lora_B.weight`` ``(d_out, r)``, copied as
they are, with peft's scale ``lora_alpha / r``.
"""

from __future__ import annotations

from typing import Any

import jax

from theseus.jobs import RegisteredFamily
from theseus.model.family import HFTensor, Part
from theseus.model.lora import merged_params
from theseus.sharding.layout import leaf_at
from theseus.training.finetune import Partition, is_adapter
from theseus.training.trainer import BaseTrainer

#: The prefix peft gives a causal language model's module names.
PEFT_PREFIX = "base_model.model."


def adapter_tensors(
    family: RegisteredFamily, tensors: list[HFTensor], params: dict
) -> list[HFTensor]:
    """peft's tensors of the adapters in ``params`` (stacked along ``n_layer``), named after the
    Hugging Face weights (``tensors``) they adapt: those of the family's ``peft_targets``."""
    targets = family.family.hf.peft_targets
    if not targets:
        raise ValueError(
            f"--adapters: the {family.name} family names no projection peft can adapt in its "
            "Hugging Face model (HFSpec.peft_targets; GPT-2 fuses q, k and v into one c_attn). "
            "Export the merged weights (without --adapters)."
        )
    found, exported = [], set()
    for tensor in tensors:
        module = tensor.name.split(".")[-2]
        if module not in targets:
            continue
        (part,) = tensor.parts
        module_path, _, leaf = part.path.rpartition("/")
        if leaf != "weight" or not _has(params, f"{module_path}/lora_a"):
            continue
        exported.add(module_path)
        stem = PEFT_PREFIX + tensor.name.removesuffix(".weight")
        rank = leaf_at(params, f"{module_path}/lora_a").shape[-2]
        d_out, d_in = tensor.shape
        for name, path, shape in (
            ("lora_A", f"{module_path}/lora_a", (rank, d_in)),
            ("lora_B", f"{module_path}/lora_b", (d_out, rank)),
        ):
            found.append(
                HFTensor(f"{stem}.{name}.weight", shape, (Part(path, part.layer, 0, shape[-1]),))
            )
    left = sorted(set(_adapted(params)) - exported)
    if left:
        raise ValueError(
            f"--adapters: this {family.name} run has adapters on {', '.join(left)}, which peft "
            f"cannot load into the family's Hugging Face model: peft adapts its modules "
            f"{', '.join(targets)} (a mixture of experts' router is no Linear module in "
            "transformers 5, and its experts are 3-D parameters with gate and up fused, which "
            "separate per-expert gate and up adapters do not map onto). Export the merged "
            "weights (without --adapters), or fine-tune with finetune.lora_targets limited to "
            "those modules."
        )
    return found


def _adapted(params: dict, prefix: str = "") -> list[str]:
    """The paths of the modules of ``params`` that hold adapters."""
    found = [prefix.rstrip("/")] if "lora_a" in params else []
    for key, node in params.items():
        if isinstance(node, dict):
            found += _adapted(node, f"{prefix}{key}/")
    return found


def adapter_config(tensors: list[HFTensor], *, rank: int, alpha: float, base: str) -> dict:
    """peft's ``adapter_config.json`` for ``tensors`` (:func:`adapter_tensors`) on ``base``."""
    modules = sorted({t.name.split(".")[-3] for t in tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def merged_run_params(trainer: BaseTrainer, params: Any) -> Any:
    """A LoRA run's ``params`` (in the storage layout) with each adapted weight merged,
    ``W + (alpha / rank) · ΔW`` in float32 on the devices, and no adapters; other runs' as
    they are."""
    spec = trainer.lora_spec
    if spec is None:
        return params
    adapters = Partition(frozenset(p.path for p in trainer.abstract_leaves if is_adapter(p.path)))
    layout = adapters.split(trainer.layouts.storage)[0]
    merge = jax.jit(lambda p: merged_params(trainer.graphdef, p), out_shardings=layout)
    return merge(params)


def _has(params: dict, path: str) -> bool:
    node: Any = params
    for key in path.split("/"):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True
