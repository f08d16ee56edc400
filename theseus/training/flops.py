"""Model FLOPs per token and the accelerator peaks that turn throughput into MFU.

Model FLOPs count the matmuls a training step runs forward and backward, with one
recomputation: the output head's forward, which the backward runs again when the loss runs in
chunks (:mod:`theseus.model.head`; every step at ``training.loss_chunk`` below the sequence
length, whatever the policy). The layers' recomputation under activation checkpointing (a
policy's choice of memory over time) and the optimizer update are left out, as in the PaLM
paper's MFU. A trainer that defines ``flops_per_token()`` (every family does, from its matmul
shapes) gives its own count; any other model gets XLA's: ``cost_analysis()`` of the loss
gradient of one microbatch (whatever it runs, recomputation included), lowered for one device
with every ``lax.scan`` unrolled first. Unrolling is needed because XLA's cost analysis counts a
loop body once, whatever its trip count; attention is traced written out
(``model.attention=xla``), since the blockwise kernel's loops have trip counts known only at run
time. The lowered module is counted rather than the compiled one because compiling an unrolled
model is slow, and the two counts agree (docs/performance.md, "FLOPs per token", has the
figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core

from theseus.model.attention import kernel_override
from theseus.training.keys import validation_keys

if TYPE_CHECKING:
    from theseus.model.family import Matmuls
    from theseus.training.trainer import BaseTrainer


@dataclass(frozen=True)
class FlopsCount:
    """Training FLOPs per token and how they were counted."""

    per_token: float
    method: str


def count_flops(trainer: BaseTrainer) -> FlopsCount:
    """The trainer's own ``flops_per_token()`` when it gives one, else XLA's count."""
    own = trainer.flops_per_token()
    if own is not None:
        return FlopsCount(float(own), f"{type(trainer).__name__}.flops_per_token()")
    return FlopsCount(
        xla_flops_per_token(trainer),
        "XLA cost_analysis() of one microbatch's loss gradient, loops unrolled",
    )


def xla_flops_per_token(trainer: BaseTrainer) -> float:
    """FLOPs per token of forward and backward as XLA counts them, on one device (lowered only;
    nothing is allocated or compiled)."""
    plan = trainer.batch_plan
    tokens = jax.ShapeDtypeStruct((plan.per_device_batch_size, plan.seq_len + 1), jnp.int32)

    def loss(params, batch):  # the keys are made inside the trace, in training's shapes
        model = nnx.merge(trainer.graphdef, params)
        return trainer.loss(
            model, batch, validation_keys((plan.per_device_batch_size,)), train=True
        )

    with kernel_override("xla"):  # the model's matmuls, not the blockwise kernel's loops
        closed = jax.make_jaxpr(jax.value_and_grad(loss))(trainer.abstract_state.params, tokens)
    unrolled = core.jaxpr_as_fun(_unrolled(closed))
    leaves = jax.tree.leaves((trainer.abstract_state.params, tokens))
    cost = jax.jit(unrolled).lower(*leaves).cost_analysis()
    assert cost is not None, "XLA gave no cost analysis"  # XLA:CPU and GPU always give one
    flops = float(cost["flops"])
    return flops / (plan.per_device_batch_size * plan.seq_len)


def _unrolled(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``closed`` with every scan, at any depth, fully unrolled (``unroll=length`` lowers to
    straight-line code) and sharding constraints removed: the count is for one device holding
    everything."""
    return closed.replace(jaxpr=_unrolled_jaxpr(closed.jaxpr))


def _unrolled_jaxpr(jaxpr: core.Jaxpr) -> core.Jaxpr:
    renamed: dict = {}  # outputs of removed constraints -> their inputs

    def read(var):
        return var if isinstance(var, core.Literal) else renamed.get(var, var)

    eqns = []
    for eqn in jaxpr.eqns:
        invars = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "sharding_constraint":
            renamed.update(zip(eqn.outvars, invars, strict=True))
            continue
        params = {key: _unrolled_param(value) for key, value in eqn.params.items()}
        if eqn.primitive.name == "scan":
            params["unroll"] = params["length"]
        eqns.append(eqn.replace(invars=invars, params=params))
    return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])


def _unrolled_param(value: Any) -> Any:
    if isinstance(value, core.ClosedJaxpr):
        return _unrolled(value)
    if isinstance(value, core.Jaxpr):
        return _unrolled_jaxpr(value)
    if isinstance(value, tuple) and value and isinstance(value[0], core.ClosedJaxpr):
        return tuple(_unrolled(branch) for branch in value)  # cond branches
    return value


def flops_per_token(matmuls: Matmuls, *, seq_len: int, loss_chunk: int) -> int:
    """Training FLOPs per token of a decoder from its matmul shapes: ``6 N + 12 L T width``,
    plus ``2 V d`` when the loss runs in chunks.

    ``N`` counts the weights that multiply activations (each layer's projections and the output
    head, tied or not; an embedding lookup costs nothing). Each such weight does one
    multiply-add (2 FLOPs) per token forward and two backward (input and weight gradients): 6
    FLOPs. Attention's ``q kᵀ`` and ``probs v`` are ``2 T width`` multiply-adds per token and
    layer forward (``width``: all query heads), over all ``T`` keys of a sequence since the
    causal mask skips no work: 12 FLOPs each for training. A sequence longer than
    ``loss_chunk`` runs the head and the loss a chunk at a time under ``jax.checkpoint``
    (:func:`theseus.model.head.chunked_scores`), whose backward recomputes each chunk's logits:
    one more multiply-add of the head's ``V d`` weights per token. Biases, norms, rotary
    embeddings, softmax and the loss are left out (the tests hold it to XLA's count).
    """
    m = matmuls
    per_layer = sum(d_in * d_out for d_in, d_out in m.layer_weights)
    others = sum(d_in * d_out for d_in, d_out in m.other_weights)
    head = m.head[0] * m.head[1]
    weights = m.num_layers * per_layer + others + head
    recomputed_head = 2 * head if seq_len > loss_chunk else 0
    return 6 * weights + 12 * m.num_layers * seq_len * m.attention_width + recomputed_head


# --- peak FLOP/s ---------------------------------------------------------------------------------

# Dense (no sparsity) peak TFLOP/s per chip, by compute dtype. Float32 matmuls run at JAX's default
# precision, which is TF32 on NVIDIA GPUs and bfloat16 passes on TPUs
# (https://docs.jax.dev/en/latest/201/precision.html), so those peaks apply to "float32".
# Sources: NVIDIA H100 and H200 product pages (SXM: 989 bf16, 495 TF32; H100 PCIe: 756, 378;
# H200 NVL: 835, 418), https://www.nvidia.com/en-us/data-center/h100/ and .../h200/; NVIDIA A100
# datasheet (312 bf16, 156 TF32), https://www.nvidia.com/en-us/data-center/a100/; Google Cloud TPU
# system architecture pages (v4 275, v5e 197, v5p 459, v6e 918 bf16),
# https://cloud.google.com/tpu/docs/v4 (and /v5e, /v5p, /v6e).
# On these GPUs the dense TF32 peak is half the bfloat16 one; on TPUs float32 runs at the bfloat16
# peak.
# Matched in order against ``device.device_kind`` (lower-case substrings); first match wins, and a
# row's names are tried in the order given.


def _gpu(bfloat16: float) -> dict[str, float]:
    return {"bfloat16": bfloat16, "float32": bfloat16 / 2}


def _tpu(bfloat16: float) -> dict[str, float]:
    return {"bfloat16": bfloat16, "float32": bfloat16}


PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("h100 pcie",), _gpu(756.0)),
    (("h200 nvl",), _gpu(835.0)),
    (("h100", "h200"), _gpu(989.4)),
    (("a100",), _gpu(312.0)),
    (("tpu v4",), _tpu(275.0)),
    (("tpu v5 lite", "tpu v5e"), _tpu(197.0)),
    (("tpu v5p", "tpu v5"), _tpu(459.0)),
    (("tpu v6 lite", "tpu v6e"), _tpu(918.0)),
)


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device, or None with the reason MFU cannot be given."""

    device_kind: str
    flops_per_s: float | None
    source: str


def device_peak(device: jax.Device, dtype: str, override_tflops: float | None = None) -> Peak:
    """The peak of ``device`` for compute ``dtype`` ("float32" or "bfloat16"): the user's
    ``override_tflops`` first, then :data:`PEAK_TFLOPS`; unknown devices (CPU among them) get
    None rather than an invented figure."""
    kind = device.device_kind
    if override_tflops is not None:
        return Peak(kind, override_tflops * 1e12, "--peak-tflops")
    for patterns, peaks in PEAK_TFLOPS:
        for pattern in patterns:
            if pattern in kind.lower():
                return Peak(kind, peaks[dtype] * 1e12, f"table entry {pattern!r} ({dtype})")
    return Peak(
        kind,
        None,
        f"no peak FLOP/s known for device kind {kind!r} ({device.platform}); pass "
        "--peak-tflops (logging.peak_tflops) to report MFU",
    )
