"""The rollout of an RL job (``NAME/train/rl``) in its plan: what the generation holds per device
beside the training step, from shapes only.

A generation batch holds ``training.batch_size × rl.steps_per_generation`` completions, drawn by
the KV-cache generator (:mod:`theseus.inference.generator`) on the training mesh: one prefill over
the prompts right-padded to the prompt width (``training.seq_len − rl.max_completion_length``),
then one decode step per new token. While it runs, a device holds, beside the parameters and the
optimizer state:

- the **KV cache** of the batch's rows for ``training.seq_len`` positions, as the generator lays
  it out (:func:`~theseus.inference.generator.cache_rules`: rows over ``batch``, key and value
  heads as the compute rules split them; exact);
- the **gathered parameters**: the generator reads the parameters in the compute layout, so every
  tensor stored split over ``batch`` (FSDP) is copied whole for the generation (exact);
- the **prompts and chosen tokens**: the padded prompts, and each step's ids (whole on every
  device) and log-probabilities until the generation ends;
- the larger of the **prefill's** and a **decode step's** temporaries, as XLA:CPU lays them out
  (measured on the compiled programs' buffers: tests/test_rl_plan.py, docs/performance.md).
  Weights are read one layer at a time, sliced from the stacks and cast to the compute dtype,
  with the head (the largest vocabulary table) in it; one layer's keys and values are read as
  the attention reads them (float32 on CPU: :func:`~theseus.accounting.activations.residual_bytes`).
  The prefill holds two float32 stream-wide buffers per token and the larger of its attention
  (the layer's attention weights, its keys and values, float32 scores and their exponentials
  and the probabilities: per (row, query block) for the blockwise kernel, in a float32 buffer
  of those unless the compute dtype is narrower; all at once for the ``xla`` one, in the compute
  dtype) and its MLP (the rest of the layer's weights, the
  gate and up projections' outputs in float32 and their product in the compute dtype, per
  token). A decode step holds the layer's weights, its keys and values, the float32 logits and
  sampling buffers and, where the cache is read in a wider dtype than it is kept in (bfloat16
  on CPU), one copy of the cache.

The training step holds the model state, one microbatch's activations
(:mod:`theseus.accounting.activations`) and its completion rows (``RL_FIELDS`` int32 a token);
the run's peak is the larger of the step and the generation, on top of the parameters and
optimizer state (:func:`theseus.plan.results.memory_sum`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import numpy as np

from theseus.accounting.activations import FLOAT32, residual_bytes
from theseus.accounting.memory import CompiledStep, format_bytes
from theseus.accounting.preflight import BatchPlan
from theseus.accounting.records import json_field
from theseus.accounting.text import number_text
from theseus.inference.generator import Generator, cache_rules
from theseus.posttraining.rl.rows import RL_FIELDS
from theseus.posttraining.rl.trainer import RLTrainer
from theseus.sharding.axis import ShardingPolicy, partition_spec
from theseus.sharding.layout import shard_shape

#: float32 (rows, vocabulary) buffers of a decode step's sampling: the logits over the
#: temperature, their sorted copy, the probabilities and their cumulative sum.
SAMPLING_BUFFERS = 4


@dataclass(frozen=True)
class RolloutMemory:
    """Per-device bytes of an RL step's generation (see the module docstring) and of the
    completion rows its training step reads. ``generation`` is what the generation holds beyond
    the parameters and optimizer state; ``prefill`` and ``decode`` are temporaries."""

    rows: int = json_field("rows")  # completions of a generation batch, on all devices
    rows_per_device: int = json_field("rows_per_device")
    prompt_width: int = json_field("prompt_width")
    cache_len: int = json_field("cache_positions")
    kv_cache: int = json_field("kv_cache_bytes")
    gathered: int = json_field("gathered_params_bytes")
    tokens: int = json_field("tokens_bytes")
    prefill: int = json_field("prefill_bytes")
    decode: int = json_field("decode_bytes")
    batch: int = json_field("batch_bytes")  # the training step's completion rows

    json_properties: ClassVar[dict[str, str]] = {"generation": "generation_bytes"}

    @property
    def generation(self) -> int:
        """Bytes beyond the parameters and optimizer state while the generation runs."""
        return self.kv_cache + self.gathered + self.tokens + max(self.prefill, self.decode)

    def describe(self) -> str:
        """The generation's bytes, term by term."""
        gathered = format_bytes(self.gathered)
        return (
            f"KV cache {format_bytes(self.kv_cache)} of {number_text(self.rows_per_device)} rows "
            f"× {number_text(self.cache_len)} positions"
            + (f" + parameters gathered to the compute layout {gathered}" if self.gathered else "")
            + f" + prompts and chosen tokens {format_bytes(self.tokens)} + the larger of the "
            f"prefill's temporaries {format_bytes(self.prefill)} (prompts of "
            f"{number_text(self.prompt_width)} positions) and a decode step's "
            f"{format_bytes(self.decode)}"
        )


def rollout_memory(
    trainer: RLTrainer, policy: ShardingPolicy, batch_plan: BatchPlan, mesh_shape: dict[str, int]
) -> RolloutMemory:
    """The rollout's memory per device under ``policy`` on a mesh of ``mesh_shape``, with the
    batch split as ``batch_plan`` (the trainer's shapes only: ``trainer`` may be on another
    mesh). Nothing is allocated."""
    shape = trainer.decoder_shape()
    decoder = trainer.decoder()
    rows = batch_plan.global_batch_size * trainer.rl.steps_per_generation
    per_device = rows // batch_plan.replicas
    width, cache_len = trainer.prompt_width, trainer.seq_len
    rules = cache_rules(trainer.plan, policy)
    cache, kv, kv_layer = 0, 0, 0  # bytes; bytes of keys and values; elements of one layer's
    for array in jax.tree.leaves(decoder.cache(rows, cache_len)):
        shard = shard_shape(array.shape, partition_spec(array.names, rules), mesh_shape)
        size = math.prod(shard) * np.dtype(array.dtype).itemsize
        cache += size
        if array.names[:1] == ("n_layer",):  # a stack of keys or values, one layer a row
            kv += size
            kv_layer += math.prod(shard[1:])
    dtype_bytes = np.dtype(trainer.compute_dtype).itemsize
    read = residual_bytes(jax.default_backend(), dtype_bytes)  # keys and values as attended
    gathered, layer, table = _parameter_bytes(trainer, policy, mesh_shape, dtype_bytes)
    heads = shape.num_heads / policy.tp
    attention_weights = shape.width * (2 * shape.query_width + 2 * shape.kv_width)
    attention_weights = round(attention_weights / policy.tp * dtype_bytes)
    kernel = trainer.attention_kernel()
    if kernel.name == "blockwise":  # one (row, query block) at a time
        scores = heads * min(kernel.block_q, width) * min(kernel.block_k, cache_len)
        per_score = 2 * FLOAT32 + (dtype_bytes if dtype_bytes < FLOAT32 else 0)
    else:  # every row and query at once, the probabilities a buffer of their own
        scores = per_device * heads * width * cache_len
        per_score = 2 * FLOAT32 + dtype_bytes
    tokens = per_device * width
    stream = tokens * shape.width * 2 * FLOAT32
    attention = scores * per_score + kv_layer * read + attention_weights
    mlp = tokens * shape.mlp_width / policy.tp * (2 * FLOAT32 + dtype_bytes)
    mlp += layer - attention_weights
    prefill = max(attention, mlp) + stream + table
    copy = kv if read > dtype_bytes else 0
    logits = per_device * shape.vocab_size * SAMPLING_BUFFERS * FLOAT32
    decode = layer + kv_layer * read + copy + table + logits
    new = trainer.rl.max_completion_length
    chosen = new * (rows + per_device) * 4  # int32 ids whole, float32 log-probabilities split
    step_rows = batch_plan.accumulation_steps * batch_plan.per_device_batch_size
    return RolloutMemory(
        rows=rows,
        rows_per_device=per_device,
        prompt_width=width,
        cache_len=cache_len,
        kv_cache=cache,
        gathered=gathered,
        tokens=tokens * 4 + chosen,
        prefill=round(prefill),
        decode=round(decode),
        batch=step_rows * RL_FIELDS * (cache_len + 1) * 4,
    )


def _parameter_bytes(
    trainer: RLTrainer, policy: ShardingPolicy, mesh_shape: dict[str, int], dtype_bytes: int
) -> tuple[int, int, int]:
    """Per device under ``policy``: the parameters the generation gathers (those whose storage
    layout differs from the compute layout, in the compute layout as stored), one layer's
    weights in the compute dtype and the largest vocabulary table (the head) in it."""
    gathered, layer, table = 0, 0, 0
    for leaf in trainer.abstract_leaves:
        storage, compute = (
            partition_spec(leaf.names, trainer.plan.rules(policy, phase))
            for phase in ("storage", "compute")
        )
        elements = math.prod(shard_shape(leaf.shape, compute, mesh_shape))
        if storage != compute:
            gathered += elements * np.dtype(leaf.dtype).itemsize
        names = leaf.names or ()
        if names[:1] == ("n_layer",):
            layer += elements // leaf.shape[0] * dtype_bytes
        elif "vocab" in names:
            table = max(table, elements * dtype_bytes)
    return gathered, layer, table


@dataclass(frozen=True)
class CompiledRollout:
    """The generator's prefill and decode step compiled for an RL job's generation batch, per
    device (``memory_analysis()``; a decode step's cache is donated: its ``aliased`` bytes)."""

    prefill: CompiledStep
    decode: CompiledStep

    json_properties: ClassVar[dict[str, str]] = {"peak": "peak_bytes"}

    @property
    def peak(self) -> int:
        """The larger program's arguments, temporaries and outputs (the decode step's cache
        counted once)."""
        return max(self.prefill.peak, self.decode.peak - self.decode.aliased)

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        return (
            f"compiled rollout, per device: prefill arguments {p.arguments:,}, temporaries "
            f"{p.temporaries:,}, outputs {p.outputs:,}; decode step arguments {d.arguments:,}, "
            f"temporaries {d.temporaries:,}, outputs {d.outputs:,} ({d.aliased:,} reuse the "
            f"donated cache); peak {self.peak:,} bytes = {format_bytes(self.peak)}"
        )


def compile_rollout(trainer: RLTrainer) -> CompiledRollout:
    """The generation programs of ``trainer``'s RL run, compiled ahead of time on its mesh for
    its generation batch (nothing allocated)."""
    generator = Generator(trainer, None)
    vocab = generator.decoder.vocab_size
    prefill, decode = generator.compiled(
        trainer.num_completions, trainer.prompt_width, trainer.seq_len, vocab
    )
    return CompiledRollout(CompiledStep.of(prefill), CompiledStep.of(decode))
