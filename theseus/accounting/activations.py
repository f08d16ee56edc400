"""Activation memory of one microbatch per device, from a decoder's dimensions alone.

What a training step holds beyond the model state, as XLA lays it out (measured against
``compiled.memory_analysis()``'s temp bytes; docs/performance.md, "Activation memory"):

- **saved**: what the backward pass keeps of every layer, by recompute policy (``none``: every
  residual of the layer; ``dots``: the layer's input and the outputs of its weight matmuls;
  ``full``: the layer's input alone), stacked by the layer scan;
- **layer peak**: the transient peak of one layer's backward (its residuals as its matmuls read
  them, recomputed under ``full``/``dots``; attention's temporaries by kernel or the MLP's
  residuals, whichever is larger; the gradients flowing through it);
- **logits**: the loss's buffers. The head and the cross-entropy run a chunk of positions at a
  time (:func:`theseus.model.head.chunked_scores`): one chunk's float32 logits and their gradient
  (vocabulary × examples × chunk) and the head's float32 gradient as the chunks add to it;
  freed before the layers' backward, so the total counts the larger of the logits and the
  layer peak;
- **other**: buffers outside the layer scan (the stream around it, the dense kernel's
  loop-invariant mask), under FSDP one layer's gathered weights with their whole float32
  gradient and the tensors gathered whole where used (the token table, the head; the head's
  gradient is the loss's, the table's comes after the peak), and the microbatch's float32
  gradient before it is added to the accumulator.

The backend matters: XLA:CPU keeps the stacked compute-dtype (bfloat16) residuals in float32
(:func:`residual_bytes`), so a plan made on CPU, as ``plan --compile`` compiles, counts them at 4
bytes; on GPUs and TPUs at the compute dtype's (not measured here).

Every term is divided as the layout divides it: examples are per device (``per_device_batch_size``
of a :class:`~theseus.accounting.preflight.BatchPlan`); tensor parallelism splits heads and the
MLP width, not the residual stream or the vocabulary (theseus's TP rules leave both whole).

Attention kernels: ``xla`` is the product written out with XLA's own ops, which materialises
float32 scores and the softmax per head (memory in the square of the length; the mask is added as
0 or -inf, so no predicate is kept per layer);
``blockwise`` is the FlashAttention-2 algorithm (per query block of ``block_q`` rows, float32
scores ``block_q × block_k`` per head; the backward keeps the output and the log-sum-exp only).
Every term is checked against the compiled steps of GPT and Llama (head dims 64 and 128) at 2,048
and 32,768 tokens, one device and tp=2 + FSDP (``bench/activation_bench.py``,
docs/performance.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from theseus.accounting.preflight import BatchPlan
from theseus.accounting.records import json_field

Kernel = Literal["xla", "blockwise"]
KERNELS: tuple[Kernel, ...] = ("xla", "blockwise")
FLOAT32 = 4


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions of a decoder that its activations depend on (a family derives it from its
    config). ``query_width`` = heads × head_dim; ``kv_width`` = kv heads × head_dim;
    ``gated_mlp``: gate and up projections (SwiGLU) rather than one (GELU); ``biased``: the
    projections add a bias in float32, so their outputs are kept in float32 under ``dots``."""

    num_layers: int
    width: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_width: int
    vocab_size: int
    gated_mlp: bool
    biased: bool = False

    @property
    def query_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_weights(self) -> int:
        """One layer's projection weights (biases and norms left out)."""
        attention = self.width * (2 * self.query_width + 2 * self.kv_width)
        return attention + (3 if self.gated_mlp else 2) * self.width * self.mlp_width


@dataclass(frozen=True)
class AttentionKernel:
    """Which attention runs and, for ``blockwise``, its block sizes (queries × keys)."""

    name: Kernel = "xla"
    block_q: int = 512
    block_k: int = 512


@dataclass(frozen=True)
class Device:
    """What one device computes of a microbatch: ``examples`` of ``seq_len`` tokens, the model's
    heads and MLP split ``tp`` ways (fractions when tp does not divide them: XLA pads).
    ``residual_bytes``: the bytes per element in which the backward keeps the layers' residuals
    of the compute dtype (None: that dtype's; see :func:`residual_bytes`)."""

    examples: int
    seq_len: int
    tp: int
    dtype_bytes: int  # the compute dtype's
    residual_bytes: int | None = None
    loss_chunk: int | None = None  # positions per chunk of the loss; None: the whole sequence

    @staticmethod
    def of(
        batch: BatchPlan, tp: int, dtype_bytes: int, backend: str, loss_chunk: int | None = None
    ) -> Device:
        stored = residual_bytes(backend, dtype_bytes)
        examples, seq_len = batch.per_device_batch_size, batch.seq_len
        return Device(examples, seq_len, tp, dtype_bytes, stored, loss_chunk)

    @property
    def chunk(self) -> int:
        """Positions whose logits the loss holds at once."""
        return min(self.loss_chunk or self.seq_len, self.seq_len)

    @property
    def stored_bytes(self) -> int:
        return self.dtype_bytes if self.residual_bytes is None else self.residual_bytes

    @property
    def tokens(self) -> int:
        return self.examples * self.seq_len


@dataclass(frozen=True)
class ActivationMemory:
    """Per-device bytes of one microbatch's forward and backward beyond the model state (see
    the module docstring); ``total`` is what the plan adds to the model state: the saved
    residuals and the other buffers, with the larger of the two transient peaks (the loss's
    logits are freed before the layers' backward starts)."""

    kernel: str = json_field("attention_kernel")
    remat: str = json_field("activation_checkpointing")
    examples: int = json_field("examples_per_device")
    seq_len: int = json_field("seq_len")
    loss_chunk: int = json_field("loss_chunk")
    saved: int = json_field("saved_bytes")
    layer_peak: int = json_field("layer_peak_bytes")
    logits: int = json_field("logits_bytes")
    other: int = json_field("other_bytes")
    tp: int = json_field("tp")
    gathered: int = json_field("gathered_layer_bytes")  # FSDP's, part of ``other``

    json_properties: ClassVar[dict[str, str]] = {
        "total": "activation_bytes",
        "unpredicted": "not_predicted",
    }

    @property
    def total(self) -> int:
        return self.saved + max(self.layer_peak, self.logits) + self.other

    @property
    def unpredicted(self) -> str | None:
        """The terms this estimate counts whole that compiled steps hold only in part, where the
        plan meets them: under FSDP the gathered layer with its whole float32 gradient, under
        tp > 1 one layer's backward peak (its unsplit stream residuals and their gradients).
        How much of them is live at the step's peak depends on XLA's schedule, which the plan
        does not model: at 2,048 tokens per device with recomputation the compiled steps hold a
        sixth to a third of the gathered layer's bytes beyond what one device holds, and the
        estimate is up to 1.32× the compiled step (docs/performance.md); at 32,768 tokens the
        activations dominate and it is within 5%. None when neither applies."""
        terms = []
        if self.gathered:
            terms.append("FSDP's gathered layer and its whole float32 gradient")
        if self.tp > 1:
            terms.append("one layer's backward peak under tp")
        return " and ".join(terms) or None


def residual_bytes(backend: str, dtype_bytes: int) -> int:
    """The bytes per element of the layers' compute-dtype residuals as ``backend`` keeps them
    for the backward. XLA:CPU computes bfloat16 element-wise in float32 and hoists the
    conversion out of the backward's layer scan: every stacked bfloat16 residual is converted
    to a float32 stack before the scan (measured in the compiled steps' buffers:
    docs/performance.md), so on CPU they cost 4 bytes; GPUs and TPUs keep the compute dtype."""
    return FLOAT32 if backend == "cpu" else dtype_bytes


# --- attention, per kernel --------------------------------------------------------------------


def score_elements(shape: DecoderShape, device: Device) -> float:
    """Elements of one layer's dense scores on a device: examples × heads / tp × length²."""
    return device.examples * shape.num_heads / device.tp * device.seq_len**2


def attention_saved(shape: DecoderShape, kernel: AttentionKernel, device: Device) -> float:
    """What the backward keeps of one layer's attention core (q, k, v and the output projection's
    input are counted with the layer). ``xla``: float32 scores and float32 probabilities per head
    (XLA:CPU keeps bfloat16 probabilities in float32; a GPU would keep 2 bytes less per score;
    the mask is added, so no predicate is kept), and two float32 softmax statistics per query
    and head.
    ``blockwise``: its custom VJP's residuals, the output (a buffer of its own beside the output
    projection's input) and the float32 log-sum-exp per query and head."""
    per_query = device.tokens * shape.num_heads / device.tp * FLOAT32
    if kernel.name == "xla":
        return score_elements(shape, device) * 2 * FLOAT32 + 2 * per_query
    output = device.tokens * shape.query_width / device.tp * device.stored_bytes
    return output + per_query


def attention_transient(
    shape: DecoderShape, kernel: AttentionKernel, remat: str, device: Device
) -> float:
    """Attention's temporaries at the peak of one layer's backward. ``xla``: the float32
    gradients of the probabilities and of the scores and the mask again (measured on the
    compiled step, float32 and bfloat16 alike: :data:`XLA_BACKWARD_BYTES`). ``blockwise``: per
    query block,
    float32 scores, probabilities and their gradients (``block_q × block_k`` per head), and the
    float32 gradient accumulators of q, k and v."""
    if kernel.name == "xla":
        return score_elements(shape, device) * XLA_BACKWARD_BYTES[remat]
    heads = shape.num_heads / device.tp
    blocks = device.examples * heads * min(kernel.block_q, device.seq_len)
    blocks *= min(kernel.block_k, device.seq_len) * BLOCKWISE_SCORE_BYTES
    widths = (shape.query_width + 2 * shape.kv_width) / device.tp
    return blocks + device.tokens * widths * FLOAT32


def attention_invariant(shape: DecoderShape, kernel: AttentionKernel, device: Device) -> float:
    """Buffers XLA hoists out of the layer scan: the ``xla`` kernel's float32 masked-score
    constant (one example's worth, length² per head) when no recomputation keeps it inside."""
    if kernel.name != "xla":
        return 0.0
    return shape.num_heads / device.tp * device.seq_len**2 * FLOAT32


#: Bytes per dense score of the xla kernel's backward temporaries, by recompute policy: 9
#: without recomputation (beside the hoisted invariant), 8 after recomputing the layer's
#: residuals (measured on the compiled step: docs/performance.md).
XLA_BACKWARD_BYTES = {"none": 9.0, "dots": 8.0, "full": 8.0}


#: Bytes per score of one (query block × key block) tile that the blockwise kernel's backward
#: holds at once: scores, probabilities and their gradients in float32, partly overlapped by
#: XLA (3.5: fitted to 2-layer models of width 48, where attention's backward is the layer's
#: peak; at head dims 64 and 128 the MLP's residuals are larger and this term does not count).
BLOCKWISE_SCORE_BYTES = 3.5 * FLOAT32


# --- one layer ----------------------------------------------------------------------------------


def stream_tokens_bytes(shape: DecoderShape) -> float:
    """Bytes per token of one layer's float32 residuals: the stream and both norms'
    intermediates (6 × width) and their statistics (4)."""
    return (6 * shape.width + 4) * FLOAT32


def compute_dtype_elements(shape: DecoderShape, device: Device) -> float:
    """Elements per token of one layer's residuals in the compute dtype, attention's core aside:
    both norms' outputs, q, k, v and the output projection's input (2 × width + 2 × query width
    + 2 × kv width) and six MLP-wide intermediates (the up projections and the activation's);
    heads and the MLP divided by tp."""
    heads = (2 * shape.query_width + 2 * shape.kv_width) / device.tp
    return 2 * shape.width + heads + 6 * shape.mlp_width / device.tp


def layer_tokens_bytes(shape: DecoderShape, device: Device) -> float:
    """Bytes per token that the backward keeps of one layer without recomputation, attention's
    core aside: the float32 residuals and the compute-dtype ones as the backend stores them
    (:func:`residual_bytes`)."""
    return stream_tokens_bytes(shape) + device.stored_bytes * compute_dtype_elements(shape, device)


def matmul_outputs_bytes(shape: DecoderShape, device: Device) -> float:
    """Bytes per token that ``dots`` keeps of one layer: its float32 input and the weight
    matmuls' outputs the backward reads (q, k, v, one width-wide projection and the MLP's up
    projections), in float32 when the projections add biases, else in the compute dtype as the
    backend stores it (:func:`residual_bytes`)."""
    tp = device.tp
    out = FLOAT32 if shape.biased else device.stored_bytes
    ups = (2 if shape.gated_mlp else 1) * shape.mlp_width / tp
    widths = (shape.query_width + 2 * shape.kv_width) / tp + shape.width + ups
    return shape.width * FLOAT32 + out * widths


def layer_saved(shape: DecoderShape, kernel: AttentionKernel, remat: str, device: Device) -> float:
    """What the backward keeps of one layer under recompute policy ``remat``."""
    if remat == "full":
        return device.tokens * shape.width * FLOAT32  # the layer's input
    if remat == "dots":
        return device.tokens * matmul_outputs_bytes(shape, device)
    return device.tokens * layer_tokens_bytes(shape, device) + attention_saved(
        shape, kernel, device
    )


def layer_peak(shape: DecoderShape, kernel: AttentionKernel, remat: str, device: Device) -> float:
    """The transient peak of one layer's backward. ``xla``: reached in its attention (the MLP's
    residuals are freed by then): the dense backward's temporaries and the float32 gradients of
    the stream; under ``full`` and ``dots`` also the attention half of the layer's residuals,
    recomputed; without recomputation the dense kernel's loop invariant. ``blockwise``: the
    layer's residuals as its matmuls read them (without recomputation its compute-dtype ones,
    sliced from the stacks, in the compute dtype: cast back from float32 on CPU; recomputed
    under ``full`` and ``dots``, the float32 ones included) and the float32 gradients of the
    stream, with the larger of its MLP's residuals (read in the MLP's backward) and attention's
    backward temporaries (in attention's backward, the MLP's are freed by then)."""
    transient = attention_transient(shape, kernel, remat, device)
    stream_grads = 2 * device.tokens * shape.width * FLOAT32
    if kernel.name == "blockwise":
        mlp_elements = 6 * shape.mlp_width / device.tp
        read = compute_dtype_elements(shape, device) - mlp_elements
        read += shape.query_width / device.tp  # the kernel's output
        read *= device.dtype_bytes
        if remat != "none":
            read += stream_tokens_bytes(shape)
        mlp = device.tokens * device.dtype_bytes * mlp_elements
        return device.tokens * read + stream_grads + max(mlp, transient)
    if remat == "none":
        return transient + stream_grads + attention_invariant(shape, kernel, device)
    mlp = device.tokens * device.dtype_bytes * 6 * shape.mlp_width / device.tp
    unstacked = dataclasses.replace(device, residual_bytes=None)  # recomputed, not stored
    recomputed = layer_saved(shape, kernel, "none", unstacked) - mlp
    return recomputed + transient + stream_grads


def logits_bytes(shape: DecoderShape, device: Device) -> float:
    """The loss's buffers at its backward's peak (the vocabulary is whole on every TP device):
    one chunk's float32 logits and their gradient in the compute dtype (examples × chunk ×
    vocabulary each), and the head's float32 gradient twice, its sum over the chunks and one
    chunk's term (measured on compiled steps with a vocabulary of 32,000, one chunk and
    several: docs/performance.md)."""
    logits = device.examples * device.chunk * shape.vocab_size
    head_gradient = shape.vocab_size * shape.width * FLOAT32
    return logits * (FLOAT32 + device.dtype_bytes) + 2 * head_gradient


def outside_layers(shape: DecoderShape, device: Device) -> float:
    """The stream before and after the layer scan: the embedding's float32 output, the final
    norm's float32 intermediates and its output in the compute dtype."""
    return device.tokens * shape.width * (4 * FLOAT32 + device.dtype_bytes)


def activation_memory(
    shape: DecoderShape,
    kernel: AttentionKernel,
    remat: str,
    device: Device,
    *,
    gradient_bytes: int,
    gathered_layer_bytes: int,
) -> ActivationMemory:
    """One microbatch's activation memory per device. ``gradient_bytes``: the microbatch's
    float32 gradient (as stored: the accumulator's size); ``gathered_layer_bytes``: what the
    step gathers under FSDP (0 otherwise), in the compute layout and the dtype it is gathered
    in: the layer the scan is running, with its float32 gradient whole before it is
    reduce-scattered, and the tensors gathered whole where used (the token table, the head)."""
    other = outside_layers(shape, device) + gradient_bytes + gathered_layer_bytes
    return ActivationMemory(
        kernel=kernel.name,
        remat=remat,
        examples=device.examples,
        seq_len=device.seq_len,
        loss_chunk=device.chunk,
        saved=round(shape.num_layers * layer_saved(shape, kernel, remat, device)),
        layer_peak=round(layer_peak(shape, kernel, remat, device)),
        logits=round(logits_bytes(shape, device)),
        other=round(other),
        tp=device.tp,
        gathered=gathered_layer_bytes,
    )
