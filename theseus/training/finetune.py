"""Fine-tuning: the ``finetune`` config section, and which parameters a run trains.

Every job has the section; its defaults (``lora_rank=0``, nothing frozen) train every parameter
as before. With ``lora_rank > 0`` the model gets LoRA adapters (:mod:`theseus.model.lora`) and
everything else is frozen; ``freeze`` freezes further parameters (in full fine-tuning too).
A frozen parameter is stored in ``frozen_dtype`` and gathered like any parameter, but has no
gradient, no gradient sum and no optimizer state: the step differentiates the trainable tree
alone (:class:`Partition`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pydantic

from theseus.config import Section
from theseus.model.lora import ADAPTERS, LoraSpec, matches
from theseus.sharding.layout import AbstractLeaf


class FinetuneConfig(Section):
    """How a run fine-tunes its model.

    Attributes:
        lora_rank: 0 trains every parameter (full fine-tuning, the default); above 0, LoRA
            adapters of this rank are added to ``lora_targets`` and only they are trained.
        lora_alpha: adapters' outputs are scaled by ``lora_alpha / lora_rank``.
        lora_targets: patterns of the projection weights that get adapters: a parameter path or
            one component of it (fnmatch, e.g. ``layers/*_proj/weight``, ``q_proj``) or a
            logical name (e.g. ``n_mlp``); None
            (the default): every attention and MLP projection of the model.
        freeze: patterns (as above, over every parameter) of parameters trained neither by
            adapters nor directly.
        frozen_dtype: the dtype frozen parameters are stored in; None: the compute dtype
            (``training.dtype``), so bfloat16 compute keeps no float32 copy of them.
    """

    lora_rank: pydantic.StrictInt = pydantic.Field(0, description="0: full fine-tuning; >0: LoRA")
    lora_alpha: float = pydantic.Field(16.0, gt=0, description="adapter scale × lora_rank")
    lora_targets: list[str] | None = pydantic.Field(
        None, description="projections adapted (None: attention and MLP projections)"
    )
    freeze: list[str] = pydantic.Field(default_factory=list, description="parameters not trained")
    frozen_dtype: Literal["float32", "bfloat16"] | None = pydantic.Field(
        None, description="storage dtype of frozen parameters (None: training.dtype)"
    )

    @pydantic.model_validator(mode="after")
    def _rank_fits(self) -> FinetuneConfig:
        if self.lora_rank < 0:
            raise ValueError(
                f"finetune.lora_rank={self.lora_rank} must be >= 0: 0 trains every parameter, "
                "a positive rank (e.g. 8 or 16) trains LoRA adapters."
            )
        if self.lora_rank == 0 and self.lora_targets is not None:
            raise ValueError(
                f"finetune.lora_targets={self.lora_targets} asks for LoRA adapters but "
                "finetune.lora_rank=0; set a positive finetune.lora_rank (e.g. 8), or remove "
                "lora_targets for full fine-tuning."
            )
        return self


def lora_spec(config: FinetuneConfig) -> LoraSpec | None:
    """The adapters ``config`` asks for, or None (full fine-tuning)."""
    if config.lora_rank == 0:
        return None
    targets = None if config.lora_targets is None else tuple(config.lora_targets)
    return LoraSpec(config.lora_rank, config.lora_alpha, targets)


def is_adapter(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in ADAPTERS


@dataclass(frozen=True)
class Partition:
    """The paths of the frozen parameters; the rest are trained. Splits parameter-shaped trees
    (nested dicts: parameters, layouts) into their trained and frozen parts and joins them."""

    frozen: frozenset[str] = frozenset()

    def split(self, tree: Any) -> tuple[Any, Any]:
        """``(trained, frozen)``: two nested dicts holding the leaves of each kind."""
        return _split(tree, self.frozen, "")

    def trained(self, tree: Any) -> Any:
        return self.split(tree)[0]

    def join(self, trained: Any, frozen: Any) -> Any:
        return _join(trained, frozen)

    def cast_frozen(self, params: Any, dtype: jnp.dtype) -> Any:
        """``params`` with the frozen ones in ``dtype``."""
        trained, frozen = self.split(params)
        return self.join(trained, jax.tree.map(lambda p: p.astype(dtype), frozen))


def _split(tree: Any, frozen: frozenset[str], prefix: str) -> tuple[dict, dict]:
    kept, dropped = {}, {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            sub_kept, sub_dropped = _split(value, frozen, path + "/")
            if sub_kept:
                kept[key] = sub_kept
            if sub_dropped:
                dropped[key] = sub_dropped
        elif path in frozen:
            dropped[key] = value
        else:
            kept[key] = value
    return kept, dropped


def _join(a: dict, b: dict) -> dict:
    joined = dict(a)
    for key, value in b.items():
        joined[key] = _join(joined[key], value) if key in joined else value
    return joined


def partition(leaves: list[AbstractLeaf], config: FinetuneConfig, model: str) -> Partition:
    """Which of a model's parameters (``leaves``) a run with ``config`` freezes; errors name a
    ``freeze`` pattern that matches nothing, a model without adapters under LoRA, and a run
    that would train nothing."""
    paths = [leaf.path for leaf in leaves]
    frozen = set()
    if config.lora_rank > 0:
        if not any(is_adapter(p) for p in paths):
            raise ValueError(
                f"finetune.lora_rank={config.lora_rank} but {model} has no LoRA adapters: its "
                "trainer's build_model must pass lora=self.lora_spec to a model that supports "
                "them (theseus.model.lora), or set finetune.lora_rank=0."
            )
        frozen |= {p for p in paths if not is_adapter(p)}
    for pattern in config.freeze:
        hits = {leaf.path for leaf in leaves if matches(pattern, leaf.path, leaf.names or ())}
        if not hits:
            raise ValueError(
                f"finetune.freeze pattern {pattern!r} matches no parameter of {model}; "
                f"parameters: {', '.join(paths)}. A pattern matches a path or one component "
                "of it (fnmatch) or a logical name; fix or remove it."
            )
        frozen |= hits
    if len(frozen) == len(paths):
        raise ValueError(
            f"finetune.freeze={config.freeze} freezes every parameter of {model}: nothing "
            "would be trained; freeze fewer, or set finetune.lora_rank for adapters."
        )
    return Partition(frozenset(frozen))
