"""The blockwise attention kernel against the written-out product, the blocks it computes for
each kind of mask, its memory at long context, and how attention() picks a kernel."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import GPT_FAMILY, LLAMA_FAMILY

from theseus.model.attention import (
    NO_WINDOW,
    AttentionKernelError,
    AttentionMask,
    attention,
    chosen_kernel,
)
from theseus.model.blockwise import blocks_computed, blockwise_attention

TOLERANCE = 1e-5  # of the largest magnitude (the bound)


def reference(q, k, v, mask, softcap=None):
    """The product written out in float32 from the dense mask: (batch, q_len, n_heads, dim)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask.visible(), scores, -jnp.inf)  # (batch, heads, q_len, k_len)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def inputs(batch, q_len, k_len, n_heads, n_kv, dim, seed=0):
    """q, k, v and a cotangent, float32 normal (drawn by numpy: no program compiled)."""
    rng = np.random.default_rng(seed)
    q_shape, kv_shape = (batch, q_len, n_heads, dim), (batch, k_len, n_kv, dim)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in shapes)


def relative_error(got, want) -> float:
    """Largest absolute difference over the largest magnitude of ``want``, in numpy."""
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_matches(q, k, v, d_out, mask, block_q, block_k, softcap=None):
    """Output and gradients of q, k, v of the blockwise kernel within TOLERANCE of the largest
    magnitude of the reference's."""

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, mask, softcap=softcap, block_q=block_q, block_k=block_k)

    def written_out(q, k, v):
        return reference(q, k, v, mask, softcap)

    @jax.jit
    def output_and_grads(q, k, v, d_out):
        return [
            (out, *vjp(d_out))
            for out, vjp in (jax.vjp(f, q, k, v) for f in (blockwise, written_out))
        ]

    got, want = jax.device_get(output_and_grads(q, k, v, d_out))
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        # A gradient that is exactly zero (every query reads only itself: a window of 1, one
        # token) is held to the output's magnitude.
        largest = float(np.abs(y).max()) or float(np.abs(want[0]).max())
        error = float(np.abs(x - y).max()) / largest
        assert error <= TOLERANCE, (name, error)


def packed(lengths, batch=1):
    """Positions and segment ids of documents of ``lengths`` packed in one row."""
    segments = np.repeat(np.arange(len(lengths)), lengths)
    positions = np.concatenate([np.arange(n) for n in lengths])
    return jnp.asarray(np.tile(positions, (batch, 1))), jnp.asarray(np.tile(segments, (batch, 1)))


@pytest.mark.parametrize("softcap", [None, 1.7])
def test_causal_grouped_heads(softcap):
    """32 query heads over 8 key/value heads, a length no block divides."""
    q, k, v, d_out = inputs(2, 37, 37, 32, 8, 3)
    assert_matches(q, k, v, d_out, AttentionMask.causal(37), 8, 16, softcap)


def test_packed_segments_of_random_lengths():
    """Documents of random lengths, single tokens among them, each row its own packing."""
    rng = np.random.default_rng(3)
    rows = [rng.permutation([1, 1, 2, *rng.integers(1, 14, size=5)]) for _ in range(2)]
    rows = [np.append(r, 61 - r.sum()) for r in rows]
    positions, segments = zip(*(packed(r) for r in rows), strict=True)
    positions, segments = jnp.concatenate(positions), jnp.concatenate(segments)
    mask = AttentionMask(positions, positions, segments, segments)
    q, k, v, d_out = inputs(2, 61, 61, 6, 2, 5, seed=1)
    assert_matches(q, k, v, d_out, mask, 8, 8)


@pytest.mark.parametrize("window", [1, 6])
def test_windows(window):
    base = AttentionMask.causal(43)
    mask = AttentionMask(base.query_positions, base.key_positions, window=window)
    q, k, v, d_out = inputs(1, 43, 43, 4, 2, 5, seed=window)
    assert_matches(q, k, v, d_out, mask, 8, 8, softcap=2.3)


@pytest.mark.parametrize("length", [1, 4093])
def test_lengths_not_multiples_of_the_block(length):
    """From one token (one partial block) to 4,093 (eight blocks, the last partial)."""
    q, k, v, d_out = inputs(1, length, length, 1, 1, 4, seed=length)
    block = 512 if length > 100 else 8
    assert_matches(q, k, v, d_out, AttentionMask.causal(length), block, block)


@pytest.mark.parametrize("q_len", [1, 3])
def test_decoding_over_a_longer_cache(q_len):
    """Rows at different positions read a cache of 45 entries up to their own position."""
    positions = jnp.array([[9 + i for i in range(q_len)], [30 + i for i in range(q_len)]])
    mask = AttentionMask.cached(positions, 45)
    q, k, v, d_out = inputs(2, q_len, 45, 6, 3, 4, seed=q_len)
    assert_matches(q, k, v, d_out, mask, 8, 8)
    count = blocks_computed(AttentionMask.cached(jnp.array([[9]]), 45), 1, 45, 8, 8)
    assert (count.computed, count.total) == (2, 6)  # keys 0-15 of the cache, not 16-44


def test_traced_window_through_a_layer_scan():
    """The window as scanned data (one per layer), under jit and grad."""
    windows = jnp.array([NO_WINDOW, 4, 11], jnp.int32)
    q, k, v, d_out = inputs(1, 29, 29, 4, 2, 3, seed=7)
    base = AttentionMask.causal(29)

    def layers(attend):
        def step(x, window):
            mask = AttentionMask(base.query_positions, base.key_positions, window=window)
            return attend(x, k, v, mask), None

        return lambda q: (jax.lax.scan(step, q, windows)[0] * d_out).sum()

    def blockwise(q, k, v, mask):
        return blockwise_attention(q, k, v, mask, block_q=8, block_k=8)

    got = jax.jit(jax.value_and_grad(layers(blockwise)))(q)
    want = jax.jit(jax.value_and_grad(layers(reference)))(q)
    for x, y in zip(got, want, strict=True):
        assert relative_error(x, y) <= TOLERANCE


def test_blocks_computed_follow_the_mask():
    """Causal: n(n+1)/2 of n² blocks; a window of 4,096 and packed documents of 2,048 at 32,768
    tokens, blocks of 512: at most 540 and 160 of 4,096."""
    n, seq = 13, 13 * 64
    causal = blocks_computed(AttentionMask.causal(seq), seq, seq, 64, 64)
    assert (causal.computed, causal.total) == (n * (n + 1) // 2, n * n)
    base = AttentionMask.causal(32768)
    window = AttentionMask(base.query_positions, base.key_positions, window=4096)
    assert blocks_computed(window, 32768, 32768, 512, 512).computed <= 540
    positions, segments = packed([2048] * 16)
    documents = AttentionMask(positions, positions, segments, segments)
    count = blocks_computed(documents, 32768, 32768, 512, 512)
    assert count.computed <= 160 and count.total == 4096


def compiled_layer(seq: int):
    """Forward and backward of one attention layer shaped like Llama 3.1 8B's (32 query heads,
    8 key/value heads, head dim 128, bfloat16), compiled for ``seq`` tokens, not run."""
    q = jax.ShapeDtypeStruct((1, seq, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 8, 128), jnp.bfloat16)

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(lambda *qkv: attention(*qkv, AttentionMask.causal(seq)), q, k, v)
        return vjp(out)

    return jax.jit(forward_backward).lower(q, kv, kv).compile()


def test_memory_is_linear_in_the_context():
    """At 32,768 tokens: at most 2 GiB of temporaries, at most 4.5 times those at 8,192, and no
    buffer with two dimensions of the context's length in the optimised program."""
    short, long = compiled_layer(8192), compiled_layer(32768)
    temp = long.memory_analysis().temp_size_in_bytes
    assert temp <= 2 * 2**30, temp
    assert temp <= 4.5 * short.memory_analysis().temp_size_in_bytes
    shapes = re.findall(r"\[([0-9,]+)\]", long.as_text())
    square = [s for s in shapes if [int(d) for d in s.split(",") if d].count(32768) >= 2]
    assert not square, square[:3]


def test_auto_is_blockwise_on_cpu_and_xla_is_the_written_out_product():
    q, k, v, _ = inputs(1, 21, 21, 4, 2, 4)
    mask = AttentionMask.causal(21)
    assert chosen_kernel("auto", q, mask) == "blockwise"
    auto = jax.jit(lambda q, k, v: attention(q, k, v, mask, block_q=8, block_k=8))(q, k, v)
    xla = jax.jit(lambda q, k, v: attention(q, k, v, mask, kernel="xla"))(q, k, v)
    assert relative_error(auto, xla) <= TOLERANCE
    with pytest.raises(AttentionKernelError, match=r"model\.attention='flash'"):
        chosen_kernel("flash", q, mask)


def test_dropout_keeps_the_written_out_product():
    """A keep mask drops probabilities out whatever the kernel."""
    q, k, v, _ = inputs(1, 9, 9, 2, 2, 4)
    mask = AttentionMask.causal(9)
    keep = jnp.asarray(np.random.default_rng(1).random((1, 2, 9, 9)) < 0.8)

    @jax.jit
    def got_and_want(q, k, v, keep):
        got = attention(q, k, v, mask, kernel="blockwise", dropout_rate=0.2, keep=keep)
        scores = jnp.where(mask.visible(), jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0, -jnp.inf)
        probs = jnp.where(keep, jax.nn.softmax(scores, axis=-1) / 0.8, 0.0)
        return got, jnp.einsum("bhqk,bkhd->bqhd", probs, v)

    assert relative_error(*got_and_want(q, k, v, keep)) <= TOLERANCE


@pytest.mark.parametrize("family", [GPT_FAMILY, LLAMA_FAMILY], ids=["gpt", "llama"])
def test_model_attention_settings_reach_every_layer(family):
    """``model.attention`` and the block sizes become the skeleton's attention options."""
    config = family.config_class(attention="xla", attention_block_q=64, attention_block_k=32)
    options = family.model_class.skeleton_of(config, jnp.float32).attention
    assert (options.kernel, options.block_q, options.block_k) == ("xla", 64, 32)
