"""The accelerators' attention kernels (theseus/model/kernels.py) on this CPU machine: splash
attention in Pallas's interpreter against the written-out float32 attention (outputs and the
gradients of q, k and v within 1e-5 of the largest magnitude), the window convention both kernels
share, and the sentences that say why a kernel cannot serve a call."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from support import invoke

from theseus.model import kernels
from theseus.model.attention import NO_WINDOW, AttentionMask
from theseus.model.kernels import (
    cudnn_attention,
    cudnn_refusal,
    local_window,
    splash_attention,
    splash_refusal,
)

TOLERANCE = 1e-5  # of the largest magnitude (issue 36)
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 6, 2, 16  # grouped-query: 3 query heads per key head


@functools.partial(jax.jit, static_argnames="softcap")
def reference(q, k, v, mask, *, softcap=None):
    """Attention written out in float32 from the dense mask: (batch, seq, heads, head_dim)."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(t, group, axis=2) for t in (k, v))  # (batch, seq, heads, head_dim)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask.visible(), scores, -jnp.inf)  # (batch, heads, seq, seq)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def qkv(seq):
    """q, k, v float32 normal, drawn by numpy (no program compiled)."""
    rng = np.random.default_rng(seq)
    heads = (HEADS, KV_HEADS, KV_HEADS)
    return tuple(
        jnp.asarray(rng.standard_normal((BATCH, seq, h, HEAD_DIM), np.float32)) for h in heads
    )


def with_gradients(attend, q, k, v):
    """The output and the gradients of q, k, v of a loss that weighs every output element."""
    weights = np.random.default_rng(7).standard_normal(q.shape, np.float32)
    out, pullback = jax.vjp(attend, q, k, v)
    return (out, *pullback(jnp.asarray(weights)))


def assert_close(got, want):
    for g, w, name in zip(got, want, ("output", "dq", "dk", "dv")[: len(got)], strict=True):
        g, w = np.asarray(g), np.asarray(w)
        largest = float(np.abs(w).max())
        error = float(np.abs(g - w).max())
        assert error <= TOLERANCE * largest, f"{name}: {error:.3g} of {largest:.3g}"


def packed_segments(seq):
    """Rows of documents (one run of tokens each, as packing writes them): 1, 60, 67 and the
    rest of ``seq`` tokens; the rest, 67, 60 and 1."""
    lengths = [1, 60, 67, seq - 128]
    rows = [np.repeat(np.arange(4), lengths), np.repeat(np.arange(4), lengths[::-1])]
    return jnp.asarray(np.stack(rows))  # (batch, seq)


def windowed(seq, window):
    """Training's mask of ``seq`` positions, reading ``window`` of them (None: all)."""
    return dataclasses.replace(AttentionMask.causal(seq), window=window)


def packed_mask(seq):
    """Training's mask of packed rows: positions restart at each document."""
    segments = packed_segments(seq)
    index = jnp.arange(seq)
    starts = jnp.concatenate([jnp.ones((BATCH, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
    positions = index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # (batch, seq)
    return AttentionMask(positions, positions, segments, segments)


CASES = {
    # name: (seq, window, softcap, packed)
    "causal, soft cap": (128, None, 5.0, False),
    "packed segments": (256, None, None, True),
    "window across blocks": (256, 37, None, False),
}


@pytest.mark.parametrize("case", CASES)
def test_splash_matches_the_written_out_attention(case):
    seq, window, softcap, packed = CASES[case]
    q, k, v = qkv(seq)
    mask = AttentionMask.causal(seq)
    if packed:
        mask = packed_mask(seq)
    mask = dataclasses.replace(mask, window=window)

    def splash(q, k, v):
        options = {"scale": None, "softcap": softcap, "windows": ()}
        return splash_attention(q, k, v, mask, **options, interpret=True)

    got = jax.jit(lambda q, k, v: with_gradients(splash, q, k, v))(q, k, v)
    written_out = jax.jit(lambda q, k, v: reference(q, k, v, mask, softcap=softcap))
    assert_close(got, jax.jit(functools.partial(with_gradients, written_out))(q, k, v))


def test_splash_picks_the_traced_window_of_a_layer_scan():
    """One compiled program, one kernel per static window (lax.switch), gradients included: the
    window chosen by data; a window outside those given gives NaNs rather than another window's
    attention."""
    seq, windows = 256, (37, None)  # None: a whole-context layer, traced as NO_WINDOW
    q, k, v = qkv(seq)

    @jax.jit
    def splash(window):
        def attend(q, k, v):
            options = {"scale": None, "softcap": None, "windows": windows}
            return splash_attention(q, k, v, windowed(seq, window), **options, interpret=True)

        return with_gradients(attend, q, k, v)

    for window in (37, NO_WINDOW):
        mask = windowed(seq, window)
        want = with_gradients(lambda q, k, v, mask=mask: reference(q, k, v, mask), q, k, v)
        assert_close(splash(jnp.int32(window)), want)
    assert bool(jnp.isnan(splash(jnp.int32(50))[0]).all())


def mesh_2x2():
    """A mesh of 2 replicas × 2 tensor-parallel devices of the simulated ones."""
    return jax.make_mesh(
        (2, 2), ("batch", "shard"), (AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )


def test_splash_on_a_mesh_runs_per_device():
    """Under a mesh (2 × 2 of the simulated devices), each device runs splash on its examples
    (over `batch`) and heads (over `shard`): a Pallas call has no partitioning rule of its own."""
    seq = 128
    q, k, v = qkv(seq)
    mask = packed_mask(seq)

    def splash(q, k, v):
        options = {"scale": None, "softcap": None, "windows": ()}
        return splash_attention(q, k, v, mask, **options, interpret=True)

    step = jax.jit(lambda q, k, v: with_gradients(splash, q, k, v))
    with jax.set_mesh(mesh_2x2()):
        assert "shard_map" in str(jax.make_jaxpr(splash)(q, k, v))
        got = step(q, k, v)
    want = with_gradients(lambda q, k, v: reference(q, k, v, mask), q, k, v)
    assert_close(got, want)


def test_window_convention():
    """A Hugging Face window w (key k read by query q when q - w < k <= q) is jax's left window
    w - 1 (cuDNN's window w, which jax passes as left + 1); one of the whole sequence is none."""
    assert kernels.WHOLE_CONTEXT == NO_WINDOW
    assert local_window(37, 256) == (36, 0)
    assert local_window(1, 256) == (0, 0)
    assert [local_window(w, 256) for w in (None, 256, 4096, NO_WINDOW)] == [None] * 4


def test_cudnn_attention_on_jax_xla_path(monkeypatch):
    """cuDNN's call as cudnn_attention makes it (causal, the window's local_window_size, the
    traced window through lax.switch), run by jax's XLA implementation of the same arguments
    (no cuDNN here): the window convention pinned on jax 0.10.2's own semantics."""
    dot_product_attention = jax.nn.dot_product_attention

    def on_xla(*args, implementation, **options):
        assert implementation == "cudnn"
        return dot_product_attention(*args, implementation="xla", **options)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_xla)
    seq = 11
    q, k, v = qkv(seq)

    @jax.jit
    def traced(window):
        mask = windowed(seq, window)
        return cudnn_attention(q, k, v, mask, scale=None, windows=(5, None))

    for window in (None, 1, 5, seq):
        mask = windowed(seq, window)
        call = functools.partial(cudnn_attention, mask=mask, scale=None, windows=())
        got = jax.jit(call)(q, k, v)
        assert_close([got], [reference(q, k, v, mask)])
    for window in (5, NO_WINDOW):
        assert_close([traced(jnp.int32(window))], [reference(q, k, v, windowed(seq, window))])
    with jax.set_mesh(mesh_2x2()):  # per device: examples over batch, heads over shard
        assert "shard_map" in str(jax.make_jaxpr(traced)(jnp.int32(5)))
        assert_close([traced(jnp.int32(5))], [reference(q, k, v, windowed(seq, 5))])


def test_refusals_on_this_cpu_machine():
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    mask = AttentionMask.causal(128)
    assert "no NVIDIA GPU" in cudnn_refusal(q, mask, softcap=None, windows=())
    assert "splash attention is a TPU kernel" in splash_refusal(q, mask, softcap=None, windows=())


@pytest.mark.parametrize(
    ("kernel", "refusal"),
    [("cudnn", "cuDNN attention needs an NVIDIA GPU"), ("splash", "a TPU kernel")],
)
def test_train_asking_for_a_kernel_this_backend_lacks_is_one_paragraph(tmp_path, kernel, refusal):
    """``theseus train model.attention=cudnn`` (or splash) on CPU: one paragraph, exit 2, no run
    folder (refused before the data is read)."""
    out = tmp_path / "run"
    batch = ("training.batch_size=8", "training.per_device_batch_size=1")
    result = invoke("train", "--out", out, f"model.attention={kernel}", "model.n_layer=1", *batch)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: model.attention='{kernel}' cannot serve")
    assert refusal in result.output and "model.attention=auto falls back" in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("backend", "call", "refusal"),
    [
        (kernels.Backend("gpu", nvidia=True), {}, "cuDNN is not detected"),
        (kernels.Backend("gpu"), {}, "not one (ROCm)"),
        ("cuda", {"dtype": jnp.float32}, "float16 or bfloat16 and this call is float32"),
        ("cuda", {"head_dim": 192}, "multiples of 8 up to 128 on this GPU"),
        ("cuda", {"segments": True}, "packed rows"),
        ("cuda", {"softcap": 30.0}, "caps its scores at 30.0"),
        ("cuda", {"cache": 256}, "256 keys for 128 queries (a decoding cache)"),
        ("cuda", {"window": jnp.int32(5)}, "no static windows were given"),
    ],
)
def test_cudnn_refusals(monkeypatch, backend, call, refusal):
    """What cuDNN refuses on an NVIDIA GPU (faked: the backend's facts are one value)."""
    if backend == "cuda":
        backend = kernels.Backend("gpu", nvidia=True, cudnn=True, hopper=False)
    monkeypatch.setattr(kernels, "backend", lambda: backend)
    q, mask = refused_call(**call)
    assert refusal in cudnn_refusal(q, mask, softcap=call.get("softcap"), windows=())
    if backend.cudnn:  # Hopper takes heads up to 256
        hopper = dataclasses.replace(backend, hopper=True)
        monkeypatch.setattr(kernels, "backend", lambda: hopper)
        accepted = cudnn_refusal(*refused_call(head_dim=192), softcap=None, windows=())
        assert accepted is None


def refused_call(dtype=jnp.bfloat16, head_dim=64, segments=False, cache=None, window=None, **_):
    q = jnp.zeros((1, 128, 4, head_dim), dtype)
    mask = AttentionMask.causal(128)
    if segments:
        mask = dataclasses.replace(mask, query_segments=jnp.zeros((1, 128), jnp.int32))
    if cache is not None:
        mask = AttentionMask.cached(jnp.arange(128)[None], cache)
    return q, dataclasses.replace(mask, window=window)


def test_splash_refusals_on_a_tpu(monkeypatch):
    """What splash refuses on a TPU (faked), and what it serves: segments, soft caps, windows."""
    monkeypatch.setattr(kernels, "backend", lambda: kernels.Backend("tpu"))
    q, mask = refused_call()
    sliding = dataclasses.replace(mask, window=jnp.int32(5))
    packed = dataclasses.replace(mask, query_segments=jnp.zeros((1, 128), jnp.int32))
    assert splash_refusal(q, packed, softcap=30.0, windows=()) is None
    assert splash_refusal(q, sliding, softcap=None, windows=(5, NO_WINDOW)) is None
    assert "no static windows" in splash_refusal(q, sliding, softcap=None, windows=())
    odd = jnp.zeros((1, 200, 4, 64), jnp.bfloat16)
    refusal = splash_refusal(odd, AttentionMask.causal(200), softcap=None, windows=())
    assert "blocks of 128 positions and the sequence has 200" in refusal
    decoding = AttentionMask.cached(jnp.arange(128)[None], 384)
    assert "a decoding cache" in splash_refusal(q, decoding, softcap=None, windows=())
