"""The one attention of every decoder, in training and in KV-cache decoding.

Which keys a query reads is data, an :class:`AttentionMask`: the positions of the queries and of
the keys (training: ``arange`` of the sequence; decoding: the rows' positions and the cache's),
optionally the segment of each (packed rows: a query reads keys of its own segment only) and a
window (a query reads the ``window`` latest positions up to its own, as Hugging Face's sliding
window: key ``k`` is read by query ``q`` when ``q - window < k <= q``). The mask is a pytree, so
its arrays, the window among them, may be traced (one window per layer through
:func:`theseus.scan_layers`, :data:`NO_WINDOW` for a layer that reads the whole context).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import pydantic

from theseus.config import Section
from theseus.model.blockwise import blockwise_attention
from theseus.model.kernels import per_device
from theseus.model.layers import apply_dropout

logger = logging.getLogger(__name__)

#: The attention kernels a model may ask for (``model.attention``): ``auto`` picks by backend
#: and mask; ``xla`` is the written-out product (scores of T × T, XLA's own ops).
Kernel = Literal["auto", "blockwise", "xla", "cudnn", "splash"]
KERNELS: tuple[str, ...] = get_args(Kernel)

#: The blockwise kernel's block of queries and of keys when the model gives none, on every
#: backend: measured on CPU (bench/attention_bench.py, docs/performance.md), not yet on GPU/TPU.
DEFAULT_BLOCK = 512

#: The window of a layer that attends the whole context (no position is that far back).
NO_WINDOW = int(jnp.iinfo(jnp.int32).max)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMask:
    """What keys each query reads: a key at a position up to the query's own, of the same
    segment when segments are given, at most ``window - 1`` positions before it when a window
    is given. Positions and segments are int arrays ``(batch or 1, length)``."""

    query_positions: jax.Array
    key_positions: jax.Array
    query_segments: jax.Array | None = None
    key_segments: jax.Array | None = None
    window: int | jax.Array | None = None

    @staticmethod
    def causal(seq: int) -> AttentionMask:
        """Training's mask: each of ``seq`` positions reads itself and the ones before."""
        positions = jnp.arange(seq)[None]  # (1, seq)
        return AttentionMask(positions, positions)

    @staticmethod
    def cached(query_positions: jax.Array, cache_len: int) -> AttentionMask:
        """Decoding's mask: queries at ``query_positions`` (rows, n) read a cache of
        ``cache_len`` positions up to their own (later entries are padding or stale)."""
        return AttentionMask(query_positions, jnp.arange(cache_len)[None])

    def visible(self) -> jax.Array:
        """Whether query ``q`` reads key ``k``: bool ``(batch or 1, 1, q_len, k_len)``."""
        queries = self.query_positions[:, :, None]  # (batch, q_len, 1)
        keys = self.key_positions[:, None, :]  # (batch, 1, k_len)
        visible = keys <= queries
        if self.query_segments is not None and self.key_segments is not None:
            same = self.query_segments[:, :, None] == self.key_segments[:, None, :]
            visible = visible & same
        if self.window is not None:
            visible = visible & (queries - keys < self.window)
        return visible[:, None]  # (batch, 1, q_len, k_len)


@dataclass(frozen=True)
class AttentionOptions:
    """How a layer attends besides its mask, as one hashable value a family's decoder carries
    (``Skeleton.attention``): ``scale`` multiplies the scores (None: 1 / sqrt(head_dim)) and
    ``softcap`` caps them at ``±cap`` (None: uncapped); ``kernel`` computes it (see
    :data:`Kernel`), the blockwise kernel in blocks of ``block_q`` queries and ``block_k`` keys
    (None: :data:`DEFAULT_BLOCK`); ``windows`` are the distinct windows a layer's traced
    ``mask.window`` may take (None: the whole context), for a kernel that needs its window
    fixed. A new attention option is a field here, passed to :func:`attention` as the keyword
    of its name."""

    scale: float | None = None
    softcap: float | None = None
    kernel: Kernel = "auto"
    block_q: int | None = None
    block_k: int | None = None
    windows: tuple[int | None, ...] = (None,)

    def keywords(self) -> dict:
        """The options as :func:`attention`'s keywords."""
        return {
            "scale": self.scale,
            "softcap": self.softcap,
            "kernel": self.kernel,
            "block_q": self.block_q,
            "block_k": self.block_k,
            "windows": self.windows,
        }


class AttentionConfig(Section):
    """The attention settings of every family's model section: ``attention``, the kernel
    (:data:`Kernel`), and with ``attention_block_q`` and ``attention_block_k`` the blockwise
    kernel's block sizes (None: the backend's default); :attr:`attention_dropout`, the rate of
    dropout on the attention probabilities in training, which a family with dropout declares."""

    attention: Kernel = pydantic.Field(
        "auto",
        description="attention kernel: auto (by backend), blockwise, xla (written out), cudnn, "
        "splash",
    )
    attention_block_q: pydantic.StrictInt | None = pydantic.Field(
        None, gt=0, description="blockwise attention: queries per block; None: backend default"
    )
    attention_block_k: pydantic.StrictInt | None = pydantic.Field(
        None, gt=0, description="blockwise attention: keys per block; None: backend default"
    )

    @property
    def attention_dropout(self) -> float:
        """The dropout rate on the attention probabilities in training: none, unless the family
        has a dropout setting (GPT's ``dropout``), whose rate it is."""
        return 0.0

    @property
    def attention_options(self) -> AttentionOptions:
        """The kernel and its block sizes as the skeleton's :class:`AttentionOptions`."""
        block_q, block_k = self.attention_block_q, self.attention_block_k
        return AttentionOptions(kernel=self.attention, block_q=block_q, block_k=block_k)


class AttentionKernelError(ValueError):
    """A model asked for an attention kernel that cannot serve its attention here."""


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap · tanh(x / cap)``: ``x`` squashed into (-cap, cap) (Gemma 2's soft-capping); None:
    ``x`` as it is."""
    return x if cap is None else jnp.tanh(x / cap) * cap


_LOGGED: set[str] = set()
_KERNEL_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attention_kernel_override", default=None
)


@contextlib.contextmanager
def kernel_override(kernel: Kernel) -> Iterator[None]:
    """Every :func:`attention` traced inside runs ``kernel``, whatever its model asks. FLOP
    counting traces the written-out product (``xla``): XLA's cost analysis counts a loop's body
    once, and the blockwise kernel's loops have traced trip counts."""
    token = _KERNEL_OVERRIDE.set(kernel)
    try:
        yield
    finally:
        _KERNEL_OVERRIDE.reset(token)


def _log_once(line: str) -> None:
    if line not in _LOGGED:
        _LOGGED.add(line)
        logger.info(line)


def kernel_refusal(name: str, q: jax.Array, mask: AttentionMask, softcap, windows) -> str | None:
    """Why the fused kernel ``name`` (cudnn, splash) cannot serve this call (None: it can)."""
    from theseus.model import kernels  # GPU/TPU only: imported when one is asked for

    if name == "cudnn":
        return kernels.cudnn_refusal(q, mask, softcap=softcap, windows=windows)
    return kernels.splash_refusal(q, mask, softcap=softcap, windows=windows)


def fused_kernel(backend: str) -> Kernel | None:
    """The fused attention kernel of a JAX backend (None: it has none)."""
    if backend in ("gpu", "cuda", "rocm"):
        return "cudnn"
    return "splash" if backend == "tpu" else None


def chosen_kernel(
    kernel: str, q: jax.Array, mask: AttentionMask, *, softcap=None, windows=(None,)
) -> str:
    """The kernel :func:`attention` runs for ``kernel`` on this backend: ``auto`` is the
    blockwise kernel on CPU, cuDNN's on GPU and splash on TPU when they can serve the call (else
    blockwise, said once in the log). An explicit kernel that cannot serve it is an
    :class:`AttentionKernelError`."""
    if kernel not in KERNELS:
        raise AttentionKernelError(
            f"model.attention={kernel!r} is not an attention kernel; choose one of {KERNELS}."
        )
    backend = jax.default_backend()
    if kernel in ("blockwise", "xla"):
        return kernel
    name = fused_kernel(backend) if kernel == "auto" else kernel
    if name is None:  # auto on a backend with no fused kernel
        return "blockwise"
    refusal = kernel_refusal(name, q, mask, softcap, windows)
    if refusal is None:
        return name
    if kernel == "auto":
        _log_once(f"attention: the blockwise kernel serves this call, not {name}: {refusal}")
        return "blockwise"
    raise _refused(kernel, refusal)


def _refused(kernel: str, refusal: str) -> AttentionKernelError:
    """The error of an explicit kernel that cannot serve (``refusal`` says what to do)."""
    return AttentionKernelError(
        f"model.attention={kernel!r} cannot serve this model's attention on the "
        f"{jax.default_backend()} backend: {refusal} (model.attention=auto falls back to the "
        "blockwise kernel where the fused one cannot serve)."
    )


def check_backend(kernel: str) -> None:
    """Refuse, before a run writes anything, a fused kernel (cudnn, splash) that this backend
    has none of; the refusals that depend on the call (dtype, head size, mask) come when the
    step is traced (:func:`chosen_kernel`)."""
    if kernel not in ("cudnn", "splash"):
        return
    from theseus.model.kernels import backend_refusal  # GPU/TPU only, as kernel_refusal

    refusal = backend_refusal(kernel)
    if refusal is not None:
        raise _refused(kernel, refusal)


def _blockwise_per_device(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    scale: float | None,
    softcap: float | None,
    blocks: tuple[int, int],
) -> jax.Array:
    """The blockwise kernel on each device's examples and heads (:func:`kernels.per_device`):
    XLA cannot partition its loops, and resharded inside them otherwise. The mask's positions and
    segments travel split as the examples are, its window whole."""
    batch = q.shape[0]
    segmented = mask.query_segments is not None
    assert segmented == (mask.key_segments is not None), "segments go with queries and keys"
    fields = [mask.query_positions, mask.key_positions]
    if mask.query_segments is not None and mask.key_segments is not None:
        fields += [mask.query_segments, mask.key_segments]
    rows = tuple(jnp.broadcast_to(f, (batch, f.shape[-1])) for f in fields)
    window = () if mask.window is None else (jnp.asarray(mask.window, jnp.int32),)

    def local(q: jax.Array, k: jax.Array, v: jax.Array, *arrays: jax.Array) -> jax.Array:
        query_segments, key_segments = (arrays[2], arrays[3]) if segmented else (None, None)
        local_window = arrays[-1] if window else None
        local_mask = AttentionMask(arrays[0], arrays[1], query_segments, key_segments, local_window)
        return blockwise_attention(
            q, k, v, local_mask, scale=scale, softcap=softcap, block_q=blocks[0], block_k=blocks[1]
        )

    return per_device(local, q, k, v, rows, window)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    kernel: Kernel = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    windows: tuple[int | None, ...] = (None,),
    dropout_rate: float = 0.0,
    keep: jax.Array | None = None,
) -> jax.Array:
    """Multi-head attention of queries ``q`` (batch, q_len, n_heads, head_dim) over keys and
    values ``k``, ``v`` (batch, k_len, n_kv_heads, head_dim), grouped-query when n_kv_heads
    divides n_heads (query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``).
    Float32 scores times ``scale`` (None: 1 / sqrt(head_dim)), soft-capped at ``softcap`` (None:
    not), and softmax; output in ``q.dtype``. Returns (batch, q_len, n_heads, head_dim).

    ``kernel`` computes it (:func:`chosen_kernel`): ``blockwise`` in blocks of ``block_q``
    queries and ``block_k`` keys that skip what the mask hides (:mod:`theseus.model.blockwise`),
    ``xla`` written out with scores of q_len × k_len, ``cudnn`` and ``splash`` the fused kernels
    of GPUs and TPUs (:mod:`theseus.model.kernels`; ``windows``: the windows ``mask.window`` may
    take). A ``keep`` mask (batch, n_heads, q_len, k_len) dropping probabilities out at
    ``dropout_rate`` is served by the written-out product whatever the kernel (said once in the
    log).
    """
    if keep is not None:
        _log_once("attention: dropout on the probabilities runs the written-out attention")
        return _written_out(q, k, v, mask, scale, softcap, dropout_rate, keep)
    requested = _KERNEL_OVERRIDE.get() or kernel
    name = chosen_kernel(requested, q, mask, softcap=softcap, windows=windows)
    if name == "blockwise":
        blocks = (block_q or DEFAULT_BLOCK, block_k or DEFAULT_BLOCK)
        return _blockwise_per_device(q, k, v, mask, scale, softcap, blocks)
    if name == "cudnn":
        from theseus.model.kernels import cudnn_attention

        return cudnn_attention(q, k, v, mask, scale=scale, windows=windows)
    if name == "splash":
        from theseus.model.kernels import splash_attention

        return splash_attention(q, k, v, mask, scale=scale, softcap=softcap, windows=windows)
    return _written_out(q, k, v, mask, scale, softcap, 0.0, None)


def _written_out(q, k, v, mask, scale, softcap, dropout_rate, keep) -> jax.Array:
    """The product written out: float32 scores (batch, n_kv, group, q_len, k_len), soft-capped,
    masked, softmax in q.dtype, dropped out by ``keep`` at ``dropout_rate``."""
    batch, q_len, n_heads, head_dim = q.shape
    k_len, n_kv = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    q = q.reshape(batch, q_len, n_kv, group, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
    if scale is None:
        scores = scores / jnp.sqrt(jnp.float32(head_dim))  # (batch, n_kv, group, q_len, k_len)
    else:
        scores = scores * jnp.float32(scale)
    scores = soft_cap(scores, softcap)  # (batch, n_kv, group, q_len, k_len)
    # Masked by adding 0 or -inf: an add's gradient reads nothing, so the layer scan keeps no
    # (q_len × k_len) predicate per layer for the backward (a select would).
    scores = scores + jnp.where(mask.visible()[:, :, None], 0.0, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # (batch, n_kv, group, q, k)
    if keep is not None:
        keep = keep.reshape(batch, n_kv, group, q_len, k_len)
    probs = apply_dropout(probs, keep, dropout_rate)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_len, n_heads, head_dim).astype(q.dtype)
