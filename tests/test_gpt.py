"""GPT: shapes, logical names, parameter count, causality, scan vs loop, remat, bf16, dense."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support import GPT, GPT_FAMILY, GPT_PLAN, GPTConfig

from theseus.model.layers import dense
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import abstract_leaves, check_layouts, layout
from theseus.sharding.topology import Topology

CONFIG = GPTConfig(vocab_size=67, block_size=11, n_layer=3, n_head=4, n_embd=24, mlp_ratio=3)
BATCH, SEQ = 2, 9
LOGICAL_NAMES = {"vocab", "block_size", "n_embd", "n_attn", "n_mlp", "n_layer", None}
EXPECTED_NAMES = {
    "wte": ("vocab", "n_embd"),
    "wpe": ("block_size", "n_embd"),
    "ln_f/scale": None,
    "ln_f/bias": None,
    **{f"blocks/{ln}/{p}": ("n_layer", None) for ln in ("ln1", "ln2") for p in ("scale", "bias")},
    **{f"blocks/attn_{x}/kernel": ("n_layer", "n_embd", "n_attn") for x in "qkv"},
    **{f"blocks/attn_{x}/bias": ("n_layer", "n_attn") for x in "qkv"},
    "blocks/attn_out/kernel": ("n_layer", "n_attn", "n_embd"),
    "blocks/attn_out/bias": ("n_layer", None),
    "blocks/mlp_fc/kernel": ("n_layer", "n_embd", "n_mlp"),
    "blocks/mlp_fc/bias": ("n_layer", "n_mlp"),
    "blocks/mlp_proj/kernel": ("n_layer", "n_mlp", "n_embd"),
    "blocks/mlp_proj/bias": ("n_layer", None),
}


def _with_params(params, dropout: float = 0.0, **options) -> GPT:
    model = GPT(CONFIG.model_copy(update={"dropout": dropout}), rngs=nnx.Rngs(0), **options)
    nnx.update(model, params)
    return model


def _loss(model: GPT, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@partial(jax.jit, static_argnums=0)
def _merged_forward(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, keys=None):
    """Logits; in training mode (dropout on) when per-example ``keys`` are given."""
    if keys is None:
        return nnx.merge(graphdef, params)(tokens)
    return nnx.merge(graphdef, params)(tokens, keys, deterministic=False)


@partial(jax.jit, static_argnums=0)
def _merged_loss_and_grads(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array):
    return jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p), tokens))(params)


def _forward(model: GPT, tokens: jax.Array, keys: jax.Array | None = None) -> jax.Array:
    return _merged_forward(*nnx.split(model), tokens, keys)


def _loss_and_grads(model: GPT, tokens: jax.Array) -> tuple[jax.Array, nnx.State]:
    return _merged_loss_and_grads(*nnx.split(model), tokens)


@pytest.fixture(scope="module")
def initialized() -> GPT:
    return GPT(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model(initialized) -> GPT:
    """The initialized model with noise on every parameter, so zero biases and unit scales matter
    (numpy noise: no compilation)."""
    rng = np.random.default_rng(1)
    params = jax.tree.map(
        lambda p: jnp.asarray(p + 0.1 * rng.standard_normal(p.shape, np.float32)),
        nnx.state(initialized, nnx.Param),
    )
    return _with_params(params)


@pytest.fixture(scope="module")
def tokens() -> jax.Array:
    token_ids = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (BATCH, SEQ))
    return jnp.asarray(token_ids, jnp.int32)


@pytest.fixture(scope="module")
def logits(model, tokens) -> jax.Array:
    return _forward(model, tokens)


@pytest.fixture(scope="module")
def fp32_loss_and_grads(model, tokens):
    return _loss_and_grads(model, tokens)


def _abstract_model(eager_sharding: bool = False) -> GPT:
    with nnx.use_eager_sharding(eager_sharding):
        return nnx.eval_shape(lambda: GPT(CONFIG, rngs=nnx.Rngs(0)))


def _reference_logits(params: dict, tokens: jax.Array, n_head: int) -> jax.Array:
    """Plain float32 GPT-2 with a python loop over layers, written independently of the model."""

    def norm(x, p):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) * p["scale"] + p["bias"]

    def proj(x, p):
        return x @ p["kernel"] + p["bias"]

    batch, seq = tokens.shape
    x = params["wte"][tokens] + params["wpe"][:seq]
    for i in range(CONFIG.n_layer):
        layer = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
        h = norm(x, layer["ln1"])
        q, k, v = (proj(h, layer[f"attn_{n}"]).reshape(batch, seq, n_head, -1) for n in "qkv")
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, seq, -1)
        x = x + proj(attended, layer["attn_out"])
        h = jax.nn.gelu(proj(norm(x, layer["ln2"]), layer["mlp_fc"]), approximate=True)
        x = x + proj(h, layer["mlp_proj"])
    return norm(x, params["ln_f"]) @ params["wte"].T


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": -3}, "vocab_size"),
        ({"mlp_ratio": 2.0}, "mlp_ratio"),
        ({"block_size": True}, "block_size"),
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_config_rejects_invalid_values(changes, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**changes)


def test_config_derived_widths():
    assert (CONFIG.n_attn, CONFIG.n_mlp) == (24, 72)


# --- structure ----------------------------------------------------------------------------------


def test_logits_shape_and_dtype(logits):
    assert logits.shape == (BATCH, SEQ, CONFIG.vocab_size)
    assert logits.dtype == jnp.float32


def test_sequence_longer_than_block_size_raises(model):
    with pytest.raises(ValueError, match="block_size"):
        jax.eval_shape(model, jax.ShapeDtypeStruct((1, CONFIG.block_size + 1), jnp.int32))


def test_logical_names():
    leaves, _ = abstract_leaves(nnx.state(_abstract_model(), nnx.Param))
    names = {leaf.path: leaf.names for leaf in leaves}
    assert names == EXPECTED_NAMES
    for leaf in leaves:
        assert leaf.dtype == np.float32, leaf.path
        if leaf.names is not None:
            assert len(leaf.names) == len(leaf.shape), leaf.path
            assert set(leaf.names) <= LOGICAL_NAMES, leaf.path
        if len(leaf.shape) >= 2:
            assert leaf.names is not None, leaf.path
        if "/ln" in f"/{leaf.path}":  # a LayerNorm's scale or bias
            assert leaf.names in (None, ("n_layer", None)), leaf.path
        if leaf.path.startswith("blocks/"):
            assert leaf.names[0] == "n_layer" and leaf.shape[0] == CONFIG.n_layer, leaf.path


def test_num_params():
    leaves, _ = abstract_leaves(nnx.state(_abstract_model(), nnx.Param))
    assert sum(math.prod(leaf.shape) for leaf in leaves) == GPT_FAMILY.num_params(CONFIG)
    gpt2_small = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert GPT_FAMILY.num_params(gpt2_small) == 124_439_808  # GPT-2 small with its tied head


def test_gpt2_initialization(initialized):
    blocks = initialized.blocks
    residual_std = 0.02 / math.sqrt(2 * CONFIG.n_layer)
    for param, std in [
        (initialized.wte, 0.02),
        (initialized.wpe, 0.02),
        (blocks.attn_q.weight, 0.02),
        (blocks.mlp_fc.weight, 0.02),
        (blocks.attn_out.weight, residual_std),
        (blocks.mlp_proj.weight, residual_std),
    ]:
        np.testing.assert_allclose(np.std(param[...]), std, rtol=0.1)
    assert not np.any(blocks.mlp_fc.bias[...]) and not np.any(initialized.ln_f.bias[...])
    assert np.all(blocks.ln1.scale[...] == 1) and np.all(initialized.ln_f.scale[...] == 1)


def test_abstract_build_allocates_nothing_and_needs_no_mesh():
    # With eager sharding on (flax's default) the build would fail here, without a mesh, if flax
    # applied the logical names as mesh axes.
    for eager_sharding in (False, True):
        params = nnx.state(_abstract_model(eager_sharding), nnx.Param)
        variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        assert len(variables) == len(EXPECTED_NAMES)
        assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in variables)
        assert params["wte"].get_metadata()["out_sharding"] == ("vocab", "n_embd")


def test_depth_is_scanned_and_remat_is_per_layer(tokens):
    def top_level_primitives(config, remat):
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), remat=remat))
        graphdef, params = nnx.split(abstract)
        jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params).jaxpr
        return [eqn.primitive.name for eqn in jaxpr.eqns], jaxpr

    shallow, _ = top_level_primitives(GPTConfig(n_layer=1), remat=False)
    deep, _ = top_level_primitives(GPTConfig(n_layer=6), remat=False)
    assert shallow == deep and deep.count("scan") == 1

    primitives, jaxpr = top_level_primitives(GPTConfig(n_layer=2), remat=True)
    assert "remat2" not in primitives  # jax.checkpoint's primitive
    (scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    assert "remat2" in [eqn.primitive.name for eqn in scan.params["jaxpr"].jaxpr.eqns]


# --- numerics -----------------------------------------------------------------------------------


def test_causality(model, tokens, logits):
    position = 4
    changed = tokens.at[:, position].set((tokens[:, position] + 1) % CONFIG.vocab_size)
    changed_logits = _forward(model, changed)
    np.testing.assert_array_equal(changed_logits[:, :position], logits[:, :position])
    assert not np.allclose(changed_logits[:, position:], logits[:, position:], atol=1e-3)


def test_scan_matches_python_loop_reference(model, tokens, logits):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    expected = jax.jit(_reference_logits, static_argnums=2)(params, tokens, CONFIG.n_head)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_remat_gives_identical_loss_and_grads(model, tokens, fp32_loss_and_grads):
    loss, grads = fp32_loss_and_grads
    remat_loss, remat_grads = _loss_and_grads(_with_params(nnx.state(model), remat=True), tokens)
    np.testing.assert_allclose(remat_loss, loss, rtol=1e-6, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), remat_grads, grads
    )


def test_bf16_compute_keeps_float32_params_and_grads(model, tokens, fp32_loss_and_grads):
    loss, grads = fp32_loss_and_grads
    bf16_model = _with_params(nnx.state(model), compute_dtype=jnp.bfloat16)
    bf16_loss, bf16_grads = _loss_and_grads(bf16_model, tokens)
    assert abs(float(bf16_loss) - float(loss)) < 0.01 * float(loss)
    for path, grad in nnx.to_flat_state(bf16_grads):
        assert grad.get_value().dtype == jnp.float32, path
    for path, param in nnx.to_flat_state(nnx.state(bf16_model, nnx.Param)):
        assert param.get_value().dtype == jnp.float32, path
    flat_grads = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])
    flat_bf16 = jnp.concatenate([g.ravel() for g in jax.tree.leaves(bf16_grads)])
    assert jnp.linalg.norm(flat_bf16 - flat_grads) < 0.03 * jnp.linalg.norm(flat_grads)


def test_tensor_parallel_forward_matches_single_device(model, tokens, logits):
    mesh = Topology.new(ShardingPolicy(tp=4)).mesh
    graphdef, params = nnx.split(model)
    check_layouts(params, GPT_PLAN, ShardingPolicy(tp=4), mesh, phases=("compute",))
    shardings = layout(params, GPT_PLAN.tp, mesh)
    assert shardings["blocks"]["attn_q"]["kernel"].spec == P(None, None, "shard")
    sharded_logits = _merged_forward(graphdef, jax.device_put(params, shardings), tokens)
    np.testing.assert_allclose(sharded_logits, logits, rtol=1e-5, atol=1e-5)


def test_dropout_masks_belong_to_examples(model, tokens, logits):
    """Dropout draws from each example's key alone: an example's logits do not depend on the rest
    of the batch; deterministic calls (the default) ignore dropout, and training needs keys."""
    dropping = _with_params(nnx.state(model, nnx.Param), dropout=0.3)
    keys = jax.vmap(jax.random.key)(jnp.arange(BATCH))  # (batch,)
    both = _forward(dropping, tokens, keys)  # (batch, seq, vocab)
    alone = _forward(dropping, tokens[1:], keys[1:])
    np.testing.assert_allclose(alone, both[1:], rtol=1e-5, atol=1e-5)
    assert np.abs(both - logits).max() > 0.01
    np.testing.assert_array_equal(_forward(dropping, tokens), logits)
    with pytest.raises(ValueError, match="needs one key per example"):
        dropping(tokens, deterministic=False)


# --- dense --------------------------------------------------------------------------------------


def _dense_inputs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 16), np.float32)  # (batch, seq, d_in)
    w = rng.standard_normal((16, 8), np.float32) / 4  # (d_in, d_out)
    cotangent = rng.standard_normal((2, 5, 8), np.float32)  # (batch, seq, d_out)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(cotangent)


def test_dense_at_float32_is_exactly_matmul():
    x, w, cotangent = _dense_inputs()
    out, vjp = jax.vjp(dense, x, w)
    expected, expected_vjp = jax.vjp(lambda x, w: x @ w, x, w)
    np.testing.assert_array_equal(out, expected)
    # The weight gradient contracts batch and sequence in one dot; JAX's own transpose of `@` may
    # sum them in another order (jax 0.12 does), so equal up to float32 rounding.
    for grad, expected_grad in zip(vjp(cotangent), expected_vjp(cotangent), strict=True):
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_dense_transposed_takes_the_weight_as_out_by_in():
    x, w, cotangent = _dense_inputs()
    out, vjp = jax.vjp(partial(dense, transposed=True), x, w.T)
    expected, expected_vjp = jax.vjp(dense, x, w)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    grad_x, grad_w_transposed = vjp(cotangent)
    expected_grad_x, expected_grad_w = expected_vjp(cotangent)
    np.testing.assert_allclose(grad_x, expected_grad_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad_w_transposed, expected_grad_w.T, rtol=1e-6, atol=1e-6)


def test_dense_bf16_weight_grads_are_float32_and_accumulated_in_float32():
    x, w, cotangent = _dense_inputs()
    x, cotangent = x.astype(jnp.bfloat16), cotangent.astype(jnp.bfloat16)
    out, vjp = jax.vjp(dense, x, w)
    grad_x, grad_w = vjp(cotangent)
    assert out.dtype == grad_x.dtype == jnp.bfloat16
    assert grad_w.dtype == jnp.float32
    assert dense(x, w, jnp.float32).dtype == jnp.float32
    # The float32 reference on the same bfloat16 values: the weight gradient, accumulated and
    # returned in float32, matches it to float32 precision; the input gradient is rounded to
    # bfloat16 (8 significant bits, relative step 2**-8 ≈ 4e-3), hence its 1e-2.
    w_bf16_values = w.astype(jnp.bfloat16).astype(jnp.float32)
    _, reference_vjp = jax.vjp(lambda x, w: x @ w, x.astype(jnp.float32), w_bf16_values)
    expected_grad_x, expected_grad_w = reference_vjp(cotangent.astype(jnp.float32))
    np.testing.assert_allclose(grad_w, expected_grad_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_x.astype(jnp.float32), expected_grad_x, rtol=1e-2, atol=1e-2)
