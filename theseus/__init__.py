"""theseus: annotate a model once with logical axis names, train it under DP, TP, ZeRO or FSDP.

Its names (the sharding vocabulary ``theseus.Axis``, ``theseus.ShardingPolicy``,
``theseus.ShardingPlan``, ``theseus.Topology``, ``theseus.partition_spec``; ``theseus.chain``,
``theseus.quick``, ``theseus.register``, ``theseus.families``, ``theseus.BaseTrainer``,
``theseus.tokenize``, ``theseus.tokenize_chat``, ``theseus.generate``, ``theseus.generate_chat``,
``theseus.logits``, ``theseus.evaluate``, ``theseus.import_hf``, ``theseus.export_hf``, ...) load
their modules on first use, so ``import theseus`` and the command line start without JAX. Where
lm-evaluation-harness is installed (the ``eval`` extra), ``import theseus`` registers
``theseus.inference.harness.TheseusLM`` as its model ``theseus`` by name only: the module loads
when the harness first asks for it.
"""

import importlib.util

_LAZY = {
    "Axis": "theseus.sharding.axis",
    "ShardingPlan": "theseus.sharding.axis",
    "ShardingPolicy": "theseus.sharding.axis",
    "partition_spec": "theseus.sharding.axis",
    "Topology": "theseus.sharding.topology",
    "chain": "theseus.execution",
    "quick": "theseus.execution",
    "Chain": "theseus.execution",
    "register": "theseus.jobs",
    "register_job": "theseus.jobs",
    "families": "theseus.jobs",
    "register_family": "theseus.jobs",
    "BaseTrainer": "theseus.training.trainer",
    "TrainerConfig": "theseus.training.trainer",
    "scan_layers": "theseus.sharding.layer_scan",
    "generate": "theseus.inference",
    "generate_chat": "theseus.inference.chat",
    "logits": "theseus.inference.logits",
    "evaluate": "theseus.inference.runs",
    "import_hf": "theseus.hf.importer",
    "export_hf": "theseus.hf.exporter",
    "tokenize": "theseus.tokenization.text",
    "tokenize_chat": "theseus.tokenization.chat.corpus",
    "next_token_loss": "theseus.training.trainer",
    "Keys": "theseus.training.keys",
    "RunMode": "theseus.training.run.mode",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'theseus' has no attribute {name!r}")


def _register_with_the_harness() -> None:
    """Name ``TheseusLM`` in lm-evaluation-harness's model registry (``model="theseus"``). Its
    registry is filled with the harness's own models first: it adds them only when empty."""
    if importlib.util.find_spec("lm_eval") is None:
        return
    import lm_eval.models  # noqa: F401 - registers the harness's own models
    from lm_eval.api.registry import model_registry

    if "theseus" not in model_registry:
        model_registry.register("theseus", target="theseus.inference.harness:TheseusLM")


_register_with_the_harness()
