"""The KV-cache decoder's bounded cache: sliding layers keep a ring of their window, full layers
the whole context, and decoding past several windows (prompts of different lengths, one longer
than the window, right-padded into one batch) gives the logits of the whole sequence through
``run``. (Greedy tokens against transformers: tests/test_hf.py; every layout:
tests/test_generate.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import EQUIVALENCE_LLAMA, FAMILIES

from theseus.model.decoder import run
from theseus.model.kv_cache import EMPTY
from theseus.model.parts import arrays

GEMMA = FAMILIES["gemma"].family
# Windows of 4 on layers 0 and 2 of 3 (Gemma's alternation), and on every layer (Mistral's).
WINDOWED = {
    "alternating": ("sliding_attention", "full_attention", "sliding_attention"),
    "all-sliding": None,
}
LENGTHS = (7, 2, 5)  # prompts; 7 and 5 are longer than the window
WIDTH, NEW = 7, 14  # the last row ends at position 20: five windows


def model_config(layer_types):
    fields = EQUIVALENCE_LLAMA.model_dump(include=set(GEMMA.config_class.model_fields))
    return GEMMA.config_class(**fields | dict(sliding_window=4, layer_types=layer_types))


@pytest.mark.parametrize("kind", WINDOWED)
def test_sliding_layers_keep_a_ring_of_their_window(kind):
    config = model_config(WINDOWED[kind])
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GEMMA.model_class(config, rngs=nnx.Rngs(0))))
    cache = GEMMA.decoder(config, jnp.float32, graphdef).cache(3, 24)
    kv = config.n_kv
    ring = cache.pop("window_4")
    assert ring["k"].shape == ring["v"].shape == (2 if kind == "alternating" else 3, 3, 4, kv)
    assert ring["positions"].shape == (3, 4) and ring["positions"].fill == EMPTY
    if kind == "alternating":
        assert cache.pop("full")["k"].shape == (1, 3, 24, kv)
    assert not cache


@pytest.mark.parametrize("kind", WINDOWED)
def test_decoding_past_several_windows_equals_the_whole_forward(kind):
    config = model_config(WINDOWED[kind])
    model = GEMMA.model_class(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    decoder = GEMMA.decoder(config, jnp.float32, graphdef)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (3, WIDTH + NEW), np.int32)
    lengths = np.array(LENGTHS, np.int32)
    weights = arrays(model.weights())
    want = np.asarray(run(weights, jnp.asarray(ids), model.skeleton).logits)  # (3, seq, vocab)

    empty = decoder.cache(3, WIDTH + NEW)
    cache = jax.tree.map(lambda a: jnp.full(a.shape, a.fill, a.dtype), empty)
    prompts = np.where(np.arange(WIDTH) < lengths[:, None], ids[:, :WIDTH], 0)  # right-padded
    call = jax.jit(decoder)
    logits, cache = call(params, cache, prompts, np.zeros(3, np.int32), lengths)
    np.testing.assert_allclose(logits, want[np.arange(3), lengths - 1], atol=1e-5, rtol=0)
    positions = lengths
    for _ in range(NEW):  # each row reads its own next token (teacher forcing)
        token = ids[np.arange(3), positions][:, None]  # (3, 1)
        logits, cache = call(params, cache, token, positions)
        np.testing.assert_allclose(logits, want[np.arange(3), positions], atol=1e-5, rtol=0)
        positions = positions + 1
    ring = np.asarray(cache["window_4"]["positions"])  # each row's last four positions
    np.testing.assert_array_equal(np.sort(ring, axis=1), positions[:, None] - np.arange(4, 0, -1))


def test_a_long_prompt_prefill_holds_no_logits_per_position():
    """The prefill gives each row's next-token logits only: its temporaries stay below one
    float32 (prompt, vocab) array (a 256-token prompt, 16,381 ids: 16.8 MB)."""
    config = EQUIVALENCE_LLAMA.model_copy(
        update=dict(vocab_size=16381, max_position_embeddings=264)
    )
    llama = FAMILIES["llama"].family
    graphdef, params = nnx.split(
        nnx.eval_shape(lambda: llama.model_class(config, rngs=nnx.Rngs(0)))
    )
    decoder = llama.decoder(config, jnp.float32, graphdef)
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), decoder.cache(1, 264))
    tokens, rows = jax.ShapeDtypeStruct((1, 256), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    compiled = jax.jit(decoder).lower(params, cache, tokens, rows, rows).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * 16381 * 4
