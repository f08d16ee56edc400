"""A hand-written GPT train step in plain JAX (``jax.jit`` + optax, no theseus code): the
baseline the benchmarks compare theseus's step against.

It is what a careful user would write by hand for one sharding choice: the same GPT-2 math as
``theseus.model.families.gpt`` (float32 master weights, matmuls in the compute dtype with float32
accumulation and float32 weight gradients, float32 LayerNorm statistics, softmax, residual stream
and logits, a head tied to the token embedding, layers stacked and scanned, optional per-layer
remat), the same AdamW chain, and the same three layouts written out by hand as
``PartitionSpec``s per parameter: compute (TP), storage (TP, or TP+ZeRO under FSDP) and update
(TP+ZeRO under ZeRO). The parameter tree has theseus's structure, so both steps can start from
the same values and must give the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

BATCH, SHARD = "batch", "shard"


@dataclass(frozen=True)
class Model:
    """GPT-2 shape and numerics."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    mlp_ratio: int = 4
    compute_dtype: Any = jnp.float32
    remat: bool = False


@dataclass(frozen=True)
class Optimizer:
    """AdamW with global-norm clipping, warmup and cosine decay (theseus's defaults)."""

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    steps: int = 200
    min_learning_rate_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass(frozen=True)
class Sharding:
    """One policy: ``tp`` devices per replica; ZeRO partitions the update, FSDP also storage.

    ``per_layer_gather``: under FSDP, gather each layer's weights inside the layer scan, as
    theseus does (the whole model is never gathered); False gathers the whole tree before the
    loss, once per microbatch (the simplest FSDP, whose temporaries grow with depth).
    """

    tp: int = 1
    zero: bool = True
    fsdp: bool = False
    per_layer_gather: bool = True


class State(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array


# --- layouts, by hand ---------------------------------------------------------------------------


def param_specs(model: Model, tp_axis, zero_axis) -> dict:
    """PartitionSpecs of every parameter. ``tp_axis`` splits the attention and MLP widths;
    ``zero_axis`` (None, or the batch axis) also splits them and the vocabulary and position
    tables. LayerNorms, n_embd-wide biases and ``ln_f`` stay whole."""

    def both(*axes):
        axes = tuple(a for a in axes if a is not None)
        return axes if len(axes) > 1 else (axes[0] if axes else None)

    width = both(tp_axis, zero_axis)  # n_attn, n_mlp
    table = P(zero_axis, None)  # wte, wpe: (rows, n_embd)
    stacked = P(None, None)  # (n_layer, n_embd)
    into = {"kernel": P(None, None, width), "bias": P(None, width)}  # n_embd -> width
    out_of = {"kernel": P(None, width, None), "bias": stacked}  # width -> n_embd
    norm = {"scale": stacked, "bias": stacked}
    return {
        "wte": table,
        "wpe": table,
        "ln_f": {"scale": P(None), "bias": P(None)},
        "blocks": {
            "ln1": norm,
            "attn_q": into,
            "attn_k": into,
            "attn_v": into,
            "attn_out": out_of,
            "ln2": norm,
            "mlp_fc": into,
            "mlp_proj": out_of,
        },
    }


@dataclass(frozen=True)
class Layouts:
    compute: Any
    storage: Any
    update: Any


def layouts(model: Model, sharding: Sharding, mesh: jax.sharding.Mesh) -> Layouts:
    tp = param_specs(model, SHARD, None)
    tp_zero = param_specs(model, SHARD, BATCH)

    def named(specs):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)

    return Layouts(
        compute=named(tp),
        storage=named(tp_zero if sharding.fsdp else tp),
        update=named(tp_zero if sharding.zero else tp),
    )


def _is_spec(x) -> bool:
    return isinstance(x, P)


def make_mesh(tp: int) -> jax.sharding.Mesh:
    devices = np.array(jax.devices()).reshape(-1, tp)
    return jax.sharding.Mesh(devices, (BATCH, SHARD), axis_types=(jax.sharding.AxisType.Auto,) * 2)


# --- the model ----------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dense(x, w, out_dtype, w_axes="io"):
    """``x @ w`` in ``x.dtype``, float32 accumulation; float32 weight gradient."""
    out = jnp.einsum(
        f"...i,{w_axes}->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)


def _dense_fwd(x, w, out_dtype, w_axes):
    return dense(x, w, out_dtype, w_axes), (x, w)


def _dense_bwd(out_dtype, w_axes, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    gx = jnp.einsum(
        f"...o,{w_axes}->...i", g, w.astype(x.dtype), preferred_element_type=jnp.float32
    )
    gw = jnp.einsum(f"...i,...o->{w_axes}", x, g, preferred_element_type=jnp.float32)
    return gx.astype(x.dtype), gw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def linear(x, p, move=None):
    """``x @ kernel + bias`` in ``x.dtype``; with ``move`` (per-layer FSDP without full remat),
    the kernel is the stored slice and the matmul gathers it in both passes."""
    if move is None:
        out = dense(x, p["kernel"], jnp.float32)
    else:
        out = stored_dense(x, p["kernel"], jnp.float32, "io", move)
    return (out + p["bias"]).astype(x.dtype)


# --- per-layer FSDP: gather in the compute dtype, reshard after forward --------------------------

GATHERED = "gathered"


class Move(NamedTuple):
    """One layer's stored slice to its compute layout; ``dtype``: cast each shard first."""

    storage: NamedSharding
    compute: NamedSharding
    dtype: Any = None


def gather(shard, move: Move):
    """The slice in the compute layout. A cast shard travels as its bits (uint16): XLA:CPU
    widens a bfloat16 all-gather to float32. Every step is named, so a remat policy that does
    not save the name recomputes the gather from the stored shard."""
    c, name = jax.lax.with_sharding_constraint, partial(checkpoint_name, name=GATHERED)
    stored = name(c(name(shard), move.storage))
    if move.dtype is None:
        return name(c(stored, move.compute))
    bits = jax.lax.bitcast_convert_type(name(stored.astype(move.dtype)), jnp.uint16)
    bits = name(c(name(c(name(bits), move.storage)), move.compute))
    narrow = name(jax.lax.bitcast_convert_type(bits, move.dtype))
    return name(c(name(narrow.astype(shard.dtype)), move.compute))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_cast(shard, move: Move):
    """:func:`gather` whose float32 gradient goes back to storage in float32."""
    return gather(shard, move)


gather_cast.defvjp(
    lambda shard, move: (gather(shard, move), None),
    lambda move, _, g: (jax.lax.with_sharding_constraint(g, move.storage),),
)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def stored_dense(x, shard, out_dtype, w_axes, move: Move):
    """:func:`dense` of the gathered ``shard``; keeps the shard, not the gathered weight."""
    return dense(x, gather(shard, move), out_dtype, w_axes)


def _stored_dense_fwd(x, shard, out_dtype, w_axes, move):
    return stored_dense(x, shard, out_dtype, w_axes, move), (x, shard)


def _stored_dense_bwd(out_dtype, w_axes, move, residuals, g):
    x, shard = residuals
    gx, gw = _dense_bwd(out_dtype, w_axes, (x, gather(shard, move)), g)
    return gx, jax.lax.with_sharding_constraint(gw, move.storage)


stored_dense.defvjp(_stored_dense_fwd, _stored_dense_bwd)


def layer_norm(x, p, dtype):
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]).astype(dtype)


def attention(q, k, v, n_head):
    b, t, c = q.shape  # (batch, seq, n_attn)
    q, k, v = (a.reshape(b, t, n_head, c // n_head) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = s / jnp.sqrt(jnp.float32(c // n_head))  # (batch, n_head, seq, seq)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, c).astype(q.dtype)  # (batch, seq, n_attn)


def forward(model: Model, params, tokens, layer_moves=None):
    """Float32 logits (batch, seq, vocab) of tokens (batch, seq); ``layer_moves`` (one layer's
    :class:`Move` per leaf) gathers each stacked layer inside the scan: kernels in the compute
    dtype, and, without remat, again in the backward pass instead of keeping them."""
    dtype = model.compute_dtype
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]  # (batch, seq, n_embd)
    kernels = ("attn_q", "attn_k", "attn_v", "attn_out", "mlp_fc", "mlp_proj")
    stored = layer_moves is not None and not model.remat  # the matmuls gather their kernels

    def layer(x, p):
        moves = {name: None for name in kernels}
        if layer_moves is not None:
            p = {name: dict(value) for name, value in p.items()}
            for name, value in p.items():
                for leaf, shard in value.items():
                    move = layer_moves[name][leaf]
                    if leaf == "kernel" and stored:
                        moves[name] = move
                    elif leaf == "kernel":
                        value[leaf] = gather_cast(shard, move)
                    else:  # biases and LayerNorm parameters: float32, autodiff
                        value[leaf] = gather(shard, move._replace(dtype=None))
        h = layer_norm(x, p["ln1"], dtype)
        q, k, v = (linear(h, p[name], moves[name]) for name in ("attn_q", "attn_k", "attn_v"))
        attended = attention(q, k, v, model.n_head)
        x = x + linear(attended, p["attn_out"], moves["attn_out"]).astype(jnp.float32)
        h = layer_norm(x, p["ln2"], dtype)
        h = jax.nn.gelu(linear(h, p["mlp_fc"], moves["mlp_fc"]), approximate=True)
        return x + linear(h, p["mlp_proj"], moves["mlp_proj"]).astype(jnp.float32)

    if model.remat:
        layer = jax.checkpoint(layer)
    elif stored:
        policy = jax.checkpoint_policies.save_anything_except_these_names(GATHERED)
        layer = jax.checkpoint(layer, policy=policy)
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, params["blocks"])
    h = layer_norm(x, params["ln_f"], dtype)
    return dense(h, params["wte"], jnp.float32, "oi")  # (batch, seq, vocab)


def loss_fn(model: Model, params, tokens, layer_moves=None):
    """Mean next-token cross-entropy of tokens (examples, seq + 1)."""
    logits = forward(model, params, tokens[:, :-1], layer_moves)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def init_params(model: Model, key) -> dict:
    """GPT-2 initialisation (normal 0.02, residual projections scaled by depth)."""
    e, m, n = model.n_embd, model.mlp_ratio * model.n_embd, model.n_layer
    keys = iter(jax.random.split(key, 8))

    def normal(shape, std=0.02):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    def lin(d_in, d_out, std=0.02):
        return {"kernel": normal((n, d_in, d_out), std), "bias": jnp.zeros((n, d_out))}

    norm = {"scale": jnp.ones((n, e)), "bias": jnp.zeros((n, e))}
    residual = 0.02 / np.sqrt(2 * n)
    return {
        "wte": normal((model.vocab_size, e)),
        "wpe": normal((model.block_size, e)),
        "ln_f": {"scale": jnp.ones(e), "bias": jnp.zeros(e)},
        "blocks": {
            "ln1": norm,
            "attn_q": lin(e, e),
            "attn_k": lin(e, e),
            "attn_v": lin(e, e),
            "attn_out": lin(e, e, residual),
            "ln2": norm,
            "mlp_fc": lin(e, m),
            "mlp_proj": lin(m, e, residual),
        },
    }


# --- the step -----------------------------------------------------------------------------------


def optimizer(opt: Optimizer) -> tuple[optax.GradientTransformation, optax.Schedule]:
    warmup = min(opt.warmup_steps, opt.steps)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        opt.learning_rate,
        warmup,
        max(opt.steps, warmup + 1),
        opt.learning_rate * opt.min_learning_rate_ratio,
    )

    def decay_mask(params):  # matrices: kernels and the embedding tables
        return jax.tree_util.tree_map_with_path(
            lambda path, _: path[-1].key in ("kernel", "wte", "wpe"), params
        )

    tx = optax.chain(
        optax.clip_by_global_norm(opt.grad_clip),
        optax.adamw(
            schedule, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, mask=decay_mask
        ),
    )
    return tx, schedule


@dataclass(frozen=True)
class Step:
    """A compiled step and what it needs: ``init(params)`` places parameters (any placement) in
    their storage layout with fresh optimizer state; ``run(state, batch)`` is one step."""

    init: Any
    run: Any
    mesh: jax.sharding.Mesh
    batch_sharding: NamedSharding


def build(model: Model, sharding: Sharding, opt: Optimizer = Optimizer()) -> Step:
    mesh = make_mesh(sharding.tp)
    lay = layouts(model, sharding, mesh)
    tx, schedule = optimizer(opt)
    constrain = jax.lax.with_sharding_constraint
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(None, BATCH, None))

    def init(params):
        params = constrain(params, lay.storage)
        opt_state = tx.init(constrain(params, lay.update))
        return State(params, opt_state, jnp.zeros((), jnp.int32))

    abstract = jax.eval_shape(partial(init_params, model), jax.random.key(0))
    opt_layout = optax.tree_map_params(  # moments in the update layout, counters replicated
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, abstract),
        lay.update,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    state_layout = State(lay.storage, opt_layout, replicated)

    per_layer = sharding.fsdp and sharding.per_layer_gather
    # Parameters enter the loss in the compute layout, except the stacked layers under per-layer
    # gathering: they enter as stored and each layer's slice is gathered inside the scan.
    entry = {**lay.compute, "blocks": lay.storage["blocks"]} if per_layer else lay.compute
    narrow = model.compute_dtype if jnp.dtype(model.compute_dtype).itemsize < 4 else None
    layer_moves = (
        jax.tree.map(
            lambda stored, compute, kernel: Move(
                NamedSharding(mesh, P(*stored.spec[1:])),
                NamedSharding(mesh, P(*compute.spec[1:])),
                narrow if kernel else None,
            ),
            lay.storage["blocks"],
            lay.compute["blocks"],
            {k: {leaf: leaf == "kernel" for leaf in v} for k, v in lay.compute["blocks"].items()},
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        if per_layer
        else None
    )

    def step(state: State, batch):  # batch: (accumulation, examples, seq + 1)
        def micro(grad_sum, tokens):
            params = constrain(state.params, entry)
            loss, grads = jax.value_and_grad(partial(loss_fn, model, layer_moves=layer_moves))(
                params, tokens
            )
            return constrain(jax.tree.map(jnp.add, grad_sum, grads), lay.storage), loss

        zeros = constrain(jax.tree.map(jnp.zeros_like, state.params), lay.storage)
        grad_sum, losses = jax.lax.scan(micro, zeros, batch)
        grads = constrain(jax.tree.map(lambda g: g / batch.shape[0], grad_sum), lay.update)
        params = constrain(state.params, lay.update)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        params = constrain(optax.apply_updates(params, updates), lay.storage)
        metrics = {
            "loss": losses.mean(),
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state.step),
        }
        return State(params, opt_state, state.step + 1), metrics

    jit_init = jax.jit(init, out_shardings=state_layout)
    jit_step = jax.jit(
        step,
        in_shardings=(state_layout, batch_sharding),
        out_shardings=(state_layout, replicated),
        donate_argnums=0,
    )

    def under_mesh(fn):
        def wrapped(*args):
            with jax.set_mesh(mesh):
                return fn(*args)

        return wrapped

    return Step(under_mesh(jit_init), under_mesh(jit_step), mesh, batch_sharding)
