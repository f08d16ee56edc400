"""The accelerators' fused attention kernels behind :func:`theseus.model.attention.attention`:
cuDNN's (NVIDIA GPUs, through :func:`jax.nn.dot_product_attention`) and Pallas's splash attention
(TPUs), each with the question "can it serve this call?" answered as a sentence.

Both kernels read a *static* mask: causal, or causal within a window. A layer scan carries each
layer's window as data (:class:`~theseus.model.attention.AttentionMask` ``window``, traced), so a
kernel gets the tuple of the distinct windows a traced one can take (``windows``) and compiles one
branch per window, chosen by :func:`jax.lax.switch`. Both read positions by index: they serve
training masks (queries and keys at the same consecutive positions, restarting at each segment of
a packed row, each segment one run of tokens as packing writes them), not decoding's. ``mask`` is
an ``AttentionMask`` (not imported here: the attention module imports this one).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.backend import get_backend
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from theseus.sharding.axis import Axis

__all__ = [
    "backend_refusal",
    "cudnn_attention",
    "cudnn_refusal",
    "splash_attention",
    "splash_refusal",
]

#: Splash attention's largest query and key block (MaxText's); a block divides the sequence.
SPLASH_BLOCK = 512
#: Splash attention's smallest block: a TPU vector register's lanes (the kernel refuses less).
SPLASH_MIN_BLOCK = 128
#: The traced window of a whole-context layer (the attention module's ``NO_WINDOW``; not imported:
#: that module imports this one); ``windows`` may name it None.
WHOLE_CONTEXT = int(np.iinfo(np.int32).max)
#: cuDNN's largest head dimension, before and from Hopper (compute capability 9.0) on.
CUDNN_MAX_HEAD_DIM = {False: 128, True: 256}


def local_window(window: int | None, seq_len: int) -> tuple[int, int] | None:
    """The ``(left, right)`` window of jax's ``local_window_size`` and of splash's ``LocalMask``
    that reads what a Hugging Face window reads in a causal sequence of ``seq_len``.

    Key ``k`` is read by query ``q`` when ``q - window < k <= q``, i.e. ``q - k <= window - 1``;
    both conventions read ``k >= q - left``, hence ``(window - 1, 0)`` (cuDNN's own window,
    ``(pos - w, pos]``, gets ``left + 1 = window`` from jax). None: the causal mask alone reads
    it (no window, or one of at least ``seq_len``, :data:`~theseus.model.attention.NO_WINDOW`
    among them)."""
    if window is None or window >= seq_len:
        return None
    return (window - 1, 0)


def _per_window(
    window: int | jax.Array | None,
    windows: tuple[int | None, ...],
    seq_len: int,
    attend: Callable[[tuple[int, int] | None], jax.Array],
    out: jax.ShapeDtypeStruct,
) -> jax.Array:
    """``attend(local_window(window))``; a traced ``window`` through :func:`jax.lax.switch`
    over one branch per distinct static window of ``windows`` (None: the whole context, traced
    as :data:`WHOLE_CONTEXT`). A traced window outside ``windows`` (a caller's broken promise,
    which cannot raise at run time) gives NaNs, not another window's attention."""
    if window is None or isinstance(window, (int, np.integer)):
        return attend(local_window(None if window is None else int(window), seq_len))
    sides = [local_window(w, seq_len) for w in windows]
    distinct = list(dict.fromkeys(sides))  # windows of at least seq_len share one branch
    branch_of = jnp.asarray([distinct.index(s) for s in sides] + [len(distinct)], jnp.int32)
    traced = [WHOLE_CONTEXT if w is None else w for w in windows]
    matches = jnp.asarray(traced, jnp.int32) == window  # (len(windows),)
    found = jnp.where(matches.any(), jnp.argmax(matches), len(windows))
    branches: list[Callable[[], jax.Array]] = [functools.partial(attend, s) for s in distinct]
    branches.append(lambda: jnp.full(out.shape, jnp.nan, out.dtype))
    return jax.lax.switch(branch_of[found], branches)


def _window_refusal(mask: Any, windows: tuple[int | None, ...]) -> str | None:
    """Why the window cannot pick a static kernel: traced, with no windows to choose from."""
    if isinstance(mask.window, jax.Array) and not windows:
        return (
            "the layer's window is data (a layer scan carries it) and no static windows were "
            "given to compile one kernel per window; pass the model's distinct windows"
        )
    return None


def _training_refusal(kernel: str, q: jax.Array, mask: Any) -> str | None:
    """Why ``mask`` is not a training mask over ``q``'s sequence (what a static kernel reads)."""
    seq_len = q.shape[1]
    same = mask.query_positions.shape == mask.key_positions.shape
    if not same or mask.key_positions.shape[-1] != seq_len:
        return (
            f"{kernel} reads a training mask (queries and keys at the same positions) and this "
            f"call reads {mask.key_positions.shape[-1]} keys for {seq_len} queries (a decoding "
            "cache); decoding uses model.attention=blockwise or xla"
        )
    return None


@dataclass(frozen=True)
class Backend:
    """What the refusals ask of JAX's backend: its name, whether it is an NVIDIA GPU (CUDA),
    whether JAX found cuDNN there, and whether the GPU is a Hopper or later (compute
    capability 9.0: cuDNN takes larger heads)."""

    name: str
    nvidia: bool = False
    cudnn: bool = False
    hopper: bool = False


def backend() -> Backend:
    """This process's backend."""
    name = jax.default_backend()
    on_gpu = name in ("gpu", "cuda")
    if not (on_gpu and re.search("cuda", get_backend().platform_version, re.IGNORECASE)):
        return Backend(name)
    # jax 0.10.2 has no public query; this is the module jax.nn.dot_product_attention checks.
    from jax._src.lib import cuda_versions

    capability = tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))
    return Backend(name, nvidia=True, cudnn=cuda_versions is not None, hopper=capability >= (9, 0))


def per_device(
    local: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    rows: tuple[jax.Array, ...] = (),
    shared: tuple[jax.Array, ...] = (),
) -> jax.Array:
    """``local(q, k, v, *rows, *shared)`` on each device of the ambient mesh, manual over its
    automatic axes: examples over ``batch`` and heads over ``shard`` where they divide, else
    repeated. An attention kernel is a loop or a Pallas call that XLA cannot partition: it would
    gather every input onto every device (Pallas) or reshard inside the loops (the blockwise
    kernel), and a fused kernel inside the step's ``shard_map`` (manual over ``batch``) sees no
    automatic axis left. ``q``, ``k``, ``v`` (batch, seq, heads, head_dim); ``rows`` arrays
    (batch, ...) split as the examples are; ``shared`` arrays whole on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    kinds = zip(mesh.axis_names, mesh.axis_types, strict=True)
    automatic = {name for name, kind in kinds if kind == AxisType.Auto}
    inputs = (q, k, v, *rows, *shared)
    if not automatic:  # no mesh, or every axis already manual
        return local(*inputs)

    def split(axis: str, *dims: int) -> str | None:
        divides = axis in automatic and not any(d % mesh.shape[axis] for d in dims)
        return axis if divides else None

    examples, heads = split(Axis.BATCH, q.shape[0]), split(Axis.SHARD, q.shape[2], k.shape[2])
    spec = P(examples, None, heads)  # (batch, seq, heads, head_dim)
    return jax.shard_map(
        local,
        in_specs=(spec,) * 3 + (P(examples),) * len(rows) + (P(),) * len(shared),
        out_specs=spec,
        axis_names=automatic,
        check_vma=False,
    )(*inputs)


def backend_refusal(kernel: str) -> str | None:
    """Why this process's backend has no ``kernel`` (cudnn, splash) at all, whatever the call:
    cuDNN's needs an NVIDIA GPU with cuDNN found, splash a TPU. None when it has one."""
    here = backend()
    if kernel == "splash":
        if here.name == "tpu":
            return None
        return (
            f"splash attention is a TPU kernel and JAX runs on {here.name} here; use "
            "model.attention=auto or blockwise"
        )
    if not here.nvidia and here.name in ("gpu", "rocm"):
        return (
            "cuDNN attention needs an NVIDIA GPU and this GPU is not one (ROCm); use "
            "model.attention=auto or blockwise"
        )
    if not here.nvidia:
        return (
            f"cuDNN attention needs an NVIDIA GPU and JAX runs on {here.name} here (no NVIDIA "
            "GPU); use model.attention=auto or blockwise"
        )
    if not here.cudnn:
        return (
            "cuDNN is not detected (JAX's CUDA plugin brings it); install theseus with "
            "`pip install -c constraints.txt -e '.[cuda12]'` or use model.attention=blockwise"
        )
    return None


def cudnn_refusal(
    q: jax.Array, mask: Any, *, softcap: float | None, windows: tuple[int | None, ...]
) -> str | None:
    """Why cuDNN's fused attention cannot serve this call, in one sentence a user can act on;
    None when it can."""
    here = backend()
    refusal = backend_refusal("cudnn")
    if refusal is not None:
        return refusal
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        return (
            f"cuDNN attention takes float16 or bfloat16 and this call is {q.dtype}; set "
            "training.dtype=bfloat16 or use model.attention=blockwise"
        )
    head_dim, largest = q.shape[-1], CUDNN_MAX_HEAD_DIM[here.hopper]
    if head_dim > largest or head_dim % 8:
        return (
            f"cuDNN attention takes head dimensions that are multiples of 8 up to {largest} on "
            f"this GPU and this model's is {head_dim}; use model.attention=blockwise"
        )
    if mask.query_segments is not None:
        return (
            "cuDNN attention through jax takes no segment ids, so packed rows (segments) would "
            "attend across documents; use model.attention=blockwise"
        )
    if softcap is not None:
        return (
            f"cuDNN attention has no soft cap and this model caps its scores at {softcap}; use "
            "model.attention=blockwise"
        )
    return _training_refusal("cuDNN attention", q, mask) or _window_refusal(mask, windows)


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Any,
    *,
    scale: float | None,
    windows: tuple[int | None, ...],
) -> jax.Array:
    """Causal (or causal sliding-window) attention of ``q`` (batch, seq, n_heads, head_dim) over
    ``k``, ``v`` (batch, seq, n_kv_heads, head_dim) by cuDNN's fused kernel, which skips the
    blocks the mask leaves empty; a call :func:`cudnn_refusal` accepts."""
    seq_len = q.shape[1]

    def attend(sides: tuple[int, int] | None) -> jax.Array:
        def local(q, k, v):  # one device's examples and heads
            return jax.nn.dot_product_attention(
                q,
                k,
                v,
                scale=scale,
                is_causal=True,
                local_window_size=sides,
                implementation="cudnn",
            )  # (batch, seq, n_heads, head_dim)

        return per_device(local, q, k, v)

    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return _per_window(mask.window, windows, seq_len, attend, out)


def splash_block(seq_len: int) -> int | None:
    """The largest block of :data:`SPLASH_MIN_BLOCK` · 2^i up to :data:`SPLASH_BLOCK` that
    divides ``seq_len``; None when none does."""
    blocks = [b for b in (SPLASH_BLOCK, 256, SPLASH_MIN_BLOCK) if seq_len % b == 0]
    return blocks[0] if blocks else None


def splash_refusal(
    q: jax.Array, mask: Any, *, softcap: float | None, windows: tuple[int | None, ...]
) -> str | None:
    """Why splash attention cannot serve this call, in one sentence a user can act on; None when
    it can (``softcap`` it takes whatever it is)."""
    del softcap  # splash caps scores itself
    refusal = backend_refusal("splash")
    if refusal is not None:
        return refusal
    seq_len = q.shape[1]
    if splash_block(seq_len) is None:
        return (
            f"splash attention reads blocks of {SPLASH_MIN_BLOCK} positions and the sequence "
            f"has {seq_len}; set training.seq_len to a multiple of {SPLASH_MIN_BLOCK} or use "
            "model.attention=blockwise"
        )
    return _training_refusal("splash attention", q, mask) or _window_refusal(mask, windows)


@functools.lru_cache(maxsize=32)
def _splash_kernel(
    seq_len: int,
    num_heads: int,
    sides: tuple[int, int] | None,
    softcap: float | None,
    interpret: bool,
) -> Callable[..., jax.Array]:
    """Splash's kernel for one static mask (its block map is built on the host, once)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (seq_len, seq_len)
    static = splash.CausalMask(shape) if sides is None else splash.LocalMask(shape, sides, 0)
    block = splash_block(seq_len)
    assert block is not None, "splash_refusal refuses lengths no block divides"
    blocks = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    with jax.ensure_compile_time_eval():  # its block map is constants, not the caller's trace
        return splash.make_splash_mha(
            splash.MultiHeadMask([static] * num_heads),
            block_sizes=blocks,
            head_shards=1,
            q_seq_shards=1,
            attn_logits_soft_cap=softcap,
            interpret=interpret,
        )


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Any,
    *,
    scale: float | None,
    softcap: float | None,
    windows: tuple[int | None, ...],
    interpret: bool = False,
) -> jax.Array:
    """Causal (or causal sliding-window) attention of ``q`` (batch, seq, n_heads, head_dim) over
    ``k``, ``v`` (batch, seq, n_kv_heads, head_dim) by Pallas's splash kernel: grouped-query
    heads, segment ids (packed rows), scores soft-capped at ``softcap``; a call
    :func:`splash_refusal` accepts. ``scale`` (None: 1 / sqrt(head_dim)) multiplies the queries
    (splash has no scale). ``interpret`` runs Pallas's interpreter (any backend: tests)."""
    batch, seq_len, _, head_dim = q.shape
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)  # (batch, seq, n_heads, head_dim)
    segments = mask.query_segments
    if segments is not None:
        segments = jnp.broadcast_to(segments, (batch, seq_len)).astype(jnp.int32)

    def attend(sides: tuple[int, int] | None) -> jax.Array:
        def local(q, k, v, *segments):  # one device's examples and heads
            # Splash reads one example (heads, seq, head_dim) at a time.
            qh, kh, vh = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # (batch, heads, seq, dim)
            kernel = _splash_kernel(seq_len, qh.shape[1], sides, softcap, interpret)
            if not segments:
                out = jax.vmap(kernel)(qh, kh, vh)
            else:
                from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

                def one(q, k, v, ids):
                    return kernel(q, k, v, segment_ids=SegmentIds(ids, ids))

                out = jax.vmap(one)(qh, kh, vh, *segments)  # (batch, n_heads, seq, head_dim)
            return jnp.swapaxes(out, 1, 2).astype(q.dtype)  # (batch, seq, n_heads, head_dim)

        return per_device(local, scaled, k, v, () if segments is None else (segments,))

    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return _per_window(mask.window, windows, seq_len, attend, out)
