"""What the mixture-of-experts families (Qwen3-MoE, OLMoE, Mixtral) share: the expert block as a
typed weight (:class:`Experts`: a router and each expert's gated MLP), the router as
transformers computes it, dropless experts on grouped matmuls, and the routing statistics of the
auxiliary load-balancing loss.

**Router.** Logits ``h · routerᵀ`` (tokens, experts), a float32 softmax over the experts, the
``top_k`` largest probabilities (renormalised to sum to 1 when ``normalise``: Qwen3-MoE's
``norm_topk_prob``, Mixtral; OLMoE keeps them as they are). Mixtral's softmax over the top-k
logits equals the renormalised top-k probabilities, so one router serves all three.

**Dropless experts.** Each (token, choice) pair is sorted by expert and each expert multiplies
its own contiguous group of rows (:func:`jax.lax.ragged_dot_general`, the weights in Hugging
Face's ``(d_out, d_in)`` layout); the outputs return to their tokens, weighted by the router.
No token is dropped. On CPU XLA expands the grouped product to a dense one over every group
(right, not fast).

**Load balancing.** Switch Transformer's loss as transformers' ``load_balancing_loss_func``:
``E · Σₑ fₑ · Pₑ`` over the tokens of every expert layer together, ``fₑ`` the share of top-k
choices that picked expert ``e`` and ``Pₑ`` its mean router probability. Both are sums over
tokens divided by the token count, so the layers add up :class:`RouterSums` as they run and the
loss is formed once (:func:`aux_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp
from flax import nnx

from theseus.model import dispatch
from theseus.model.parts import Projection, param, stacked_projection, static, weights
from theseus.sharding.axis import N_EXPERT, token_exchange
from theseus.sharding.layer_scan import expert_placement

#: The logical name of each expert's MLP width (the expert index is :data:`N_EXPERT`, which the
#: sharding policy places).
N_EXPERT_MLP = "n_expert_mlp"

# ragged_dot_general's dimensions for rows (tokens, d_in) by weights (experts, d_out, d_in):
# the rows are ragged along their first dimension, one group per expert.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


@weights
class Experts:
    """An expert block's weights, stacked along ``n_layer``: the router ``gate`` (experts,
    n_embd), and each expert's ``gate_proj`` and ``up_proj`` (experts, n_expert_mlp, n_embd) and
    ``down_proj`` (experts, n_embd, n_expert_mlp), Hugging Face's layout, each a
    :class:`Projection` whose LoRA adapters are per expert too (``lora_a`` (experts, rank, d_in),
    ``lora_b`` (experts, d_out, rank), applied in the grouped products); ``top_k`` experts per
    token, their weights renormalised when ``normalise``; each expert takes at most ``capacity``
    × its even share of a batch's choices (None: every choice, dropless)."""

    gate: Projection
    gate_proj: Projection
    up_proj: Projection
    down_proj: Projection
    top_k: int = static()
    normalise: bool = static()
    capacity: float | None = static(None)

    @property
    def num_experts(self) -> int:
        return self.gate_proj.weight.shape[-3]

    @staticmethod
    def create(
        num_layers: int,
        num_experts: int,
        width: int,
        mlp_width: int,
        top_k: int,
        normalise: bool,
        rngs: nnx.Rngs,
        capacity: float | None = None,
    ) -> Experts:
        """An expert block normal(0.02) initialised (router first, then gate, up, down)."""
        router = stacked_projection(
            num_layers, width, num_experts, ("n_embd", N_EXPERT), "oi", bias=False, std=0.02,
            rngs=rngs,
        )  # fmt: skip
        normal = nnx.initializers.normal(0.02)
        up_names = ("n_layer", N_EXPERT, N_EXPERT_MLP, "n_embd")
        shape = (num_layers, num_experts, mlp_width, width)
        gate_proj, up_proj = (Projection(weight=param(rngs, shape, up_names, normal))
                              for _ in range(2))  # fmt: skip
        down_shape = (num_layers, num_experts, width, mlp_width)
        down_names = ("n_layer", N_EXPERT, "n_embd", N_EXPERT_MLP)
        down_proj = Projection(weight=param(rngs, down_shape, down_names, normal))
        return Experts(
            gate=router,
            gate_proj=gate_proj,
            up_proj=up_proj,
            down_proj=down_proj,
            top_k=top_k,
            normalise=normalise,
            capacity=capacity,
        )


@weights
class Routing:
    """Where a layer's router sends each token: the router ``probs`` float32 (tokens, experts),
    the chosen ``experts`` int32 (tokens, top_k), their ``weights`` (tokens, top_k) and the
    log-partition ``log_z`` float32 (tokens,) of the router logits (for the z-loss)."""

    probs: jax.Array
    experts: jax.Array
    weights: jax.Array
    log_z: jax.Array
    kept: jax.Array | None = None  # bool (tokens, top_k): the choices within capacity


def route(block: Experts, h: jax.Array) -> Routing:
    """The router's choice for the tokens ``h`` (tokens, n_embd), as transformers computes it."""
    logits = block.gate(h).astype(jnp.float32)  # (tokens, experts)
    probs = jax.nn.softmax(logits, axis=-1)  # (tokens, experts)
    # The top k by a stable sort (lower index first among equals, as lax.top_k): XLA partitions
    # a sort along the experts over the tokens' split, but gathers every token for lax.top_k.
    chosen = jnp.argsort(-probs, axis=-1, stable=True)[:, : block.top_k]  # (tokens, top_k)
    top = jnp.take_along_axis(probs, chosen, axis=-1)  # (tokens, top_k)
    if block.normalise:
        top = top / top.sum(axis=-1, keepdims=True)
    log_z = jax.nn.logsumexp(logits, axis=-1)  # (tokens,)
    chosen = chosen.astype(jnp.int32)
    return Routing(probs=probs, experts=chosen, weights=top.astype(h.dtype), log_z=log_z)


def _per_expert(
    rows: jax.Array, proj: Projection, matmul: Callable[[jax.Array, jax.Array], jax.Array]
) -> jax.Array:
    """``rows`` (n, d_in), sorted by expert, through each expert's ``proj`` (weight (experts,
    d_out, d_in)) with ``matmul(rows, weight)`` (float32 (n, d_out)): (n, d_out) in the rows'
    dtype; the LoRA adapters' share, ``scale · (rows aᵀ) bᵀ`` per expert, added in float32
    before the one rounding."""
    out = matmul(rows, proj.weight)  # (n, d_out) float32
    if proj.lora is not None:
        low = matmul(rows, proj.lora.a).astype(rows.dtype)  # (n, rank)
        out = out + matmul(low, proj.lora.b * proj.lora.scale)
    return out.astype(rows.dtype)


def _grouped_matmul(sizes: jax.Array) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """Each group of rows (n, d_in) times its expert's weight (experts, d_out, d_in): (n,
    d_out) float32; group ``e`` is ``sizes[e]`` rows."""

    def matmul(rows: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot_general(
            rows, w.astype(rows.dtype), sizes, _GROUPED, preferred_element_type=jnp.float32
        )

    return matmul


#: Rows per block of the blocked formulation (XLA:CPU, which has no grouped matmul kernel).
BLOCK_ROWS = 32


def _blocked(
    rows: jax.Array, block: Experts, sizes: jax.Array, activation: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """The experts' gated MLPs on ``rows`` (n, n_embd) sorted by expert (group ``e`` is
    ``sizes[e]`` rows), each group padded to whole blocks of :data:`BLOCK_ROWS` rows of one
    expert, each block multiplied by its expert's weights: (n, n_embd). The work is the rows'
    own plus at most ``BLOCK_ROWS - 1`` padding rows per expert."""
    n, num_experts, size = rows.shape[0], sizes.shape[0], BLOCK_ROWS
    num_blocks = -(-(n + num_experts * (size - 1)) // size)  # enough for any sizes
    padded = -(-sizes // size) * size  # (experts,)
    ends = jnp.cumsum(padded)
    expert = jnp.repeat(jnp.arange(num_experts), sizes, total_repeat_length=n)  # of each row
    slot = (ends - padded)[expert] + jnp.arange(n) - (jnp.cumsum(sizes) - sizes)[expert]
    source = jnp.full((num_blocks * size,), n).at[slot].set(jnp.arange(n))  # n: a zero row
    x = jnp.concatenate([rows, jnp.zeros_like(rows[:1])])[source]  # (blocks · size, n_embd)
    x = x.reshape(num_blocks, size, -1)
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(num_blocks) * size, side="right"),
                        num_experts - 1)  # fmt: skip

    def matmul(x: jax.Array, w: jax.Array) -> jax.Array:  # per block: (size, d_in) · w[owner]ᵀ
        w = w[owner].astype(x.dtype)  # (blocks, d_out, d_in)
        return jnp.einsum("bsi,boi->bso", x, w, preferred_element_type=jnp.float32)

    def project(x: jax.Array, proj: Projection) -> jax.Array:
        return _per_expert(x, proj, matmul)

    hidden = activation(project(x, block.gate_proj)) * project(x, block.up_proj)
    out = project(hidden, block.down_proj).reshape(num_blocks * size, -1)
    return out[slot]  # (n, n_embd), in the rows' order


def _ragged(
    rows: jax.Array, block: Experts, sizes: jax.Array, activation: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """The experts' gated MLPs on ``rows`` sorted by expert, on grouped matmuls."""
    matmul = _grouped_matmul(sizes)
    gate, up = (_per_expert(rows, p, matmul) for p in (block.gate_proj, block.up_proj))
    hidden = activation(gate) * up  # (n, n_expert_mlp)
    return _per_expert(hidden, block.down_proj, matmul)  # (n, n_embd)


def dropless(
    block: Experts,
    h: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Every expert's gated MLP on the tokens routed to it, summed per token with the router's
    weights: (tokens, n_embd) in ``h``'s dtype, from ``h`` (tokens, n_embd), the choices
    ``chosen`` int32 (tokens, top_k) (indices into the block's experts) and their ``weights``
    (tokens, top_k). On grouped matmuls where the backend has a kernel for them; on CPU, where
    XLA expands one to a dense product over every group, in padded blocks of one expert
    (:func:`_blocked`)."""
    tokens, top_k = chosen.shape
    choices = chosen.reshape(-1)  # (tokens · top_k,) in token order
    order = jnp.argsort(choices, stable=True)  # choices grouped by expert
    sizes = jnp.bincount(choices, length=block.num_experts).astype(jnp.int32)  # (experts,)
    rows = h[order // top_k]  # (tokens · top_k, n_embd), sorted by expert
    experts = _blocked if jax.default_backend() == "cpu" else _ragged
    out = experts(rows, block, sizes, activation)  # (tokens · top_k, n_embd), sorted
    unsorted = out[jnp.argsort(order)].reshape(tokens, top_k, -1)  # back in token order
    return jnp.einsum("tkd,tk->td", unsorted, weights)  # (tokens, n_embd)


def within_capacity(routing: Routing, num_experts: int, capacity: float) -> Routing:
    """``routing`` with the choices beyond each expert's capacity dropped (weight 0, not
    ``kept``): an expert takes at most ``ceil(capacity · tokens · top_k / experts)`` choices,
    those of the earliest tokens first. A capacity of experts / top_k drops nothing."""
    tokens, top_k = routing.experts.shape
    limit = math.ceil(capacity * tokens * top_k / num_experts)
    choices = routing.experts.reshape(-1)  # (tokens · top_k,) in token order
    order = jnp.argsort(choices, stable=True)  # grouped by expert, token order within
    sizes = jnp.bincount(choices, length=num_experts)  # (experts,)
    starts = jnp.cumsum(sizes) - sizes  # each expert's first row in sorted order
    rank = jnp.arange(choices.size) - starts[choices[order]]  # place within its expert
    kept = jnp.zeros(choices.shape, bool).at[order].set(rank < limit).reshape(tokens, top_k)
    weights = jnp.where(kept, routing.weights, 0)
    return Routing(
        probs=routing.probs, experts=routing.experts, weights=weights, log_z=routing.log_z,
        kept=kept,
    )  # fmt: skip


def mixture(
    block: Experts, h: jax.Array, activation: Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, Routing]:
    """The expert block on the stream ``h`` (batch, seq, n_embd): its output (same shape and
    dtype) and the router's choice for the batch's tokens in order (batch · seq rows), within
    the block's capacity when it has one. Experts the trainer's policy places on the mesh run
    where they are stored, their tokens exchanged as :func:`theseus.sharding.axis.token_exchange`
    says (:mod:`theseus.model.dispatch`); unplaced ones are left to XLA's partitioner."""
    tokens = h.reshape(-1, h.shape[-1])  # (batch · seq, n_embd)
    routing = route(block, tokens)
    if block.capacity is not None:
        routing = within_capacity(routing, block.num_experts, block.capacity)
    placement = expert_placement()
    if token_exchange(placement) != "partitioned":

        def local(mine: dispatch.Projections, h: jax.Array, chosen: jax.Array, w: jax.Array):
            gate, up, down = mine  # this device's experts
            own = replace(block, gate_proj=gate, up_proj=up, down_proj=down)
            return dropless(own, h, chosen, w, activation)

        projections = (block.gate_proj, block.up_proj, block.down_proj)
        out = dispatch.exchanged(
            local, projections, tokens, routing.experts, routing.weights, placement
        )
    else:
        out = dropless(block, tokens, routing.experts, routing.weights, activation)
    return out.reshape(h.shape), routing


@weights
class RouterSums:
    """Routing statistics summed over the tokens of every expert layer (and, in a trainer, over
    the replicas of a microbatch): the top-k ``counts`` of each expert float32 (experts,), the
    router ``probs`` summed per expert (experts,), the number of token ``rows`` (a layer's tokens
    counted once per layer), the squared log-partitions ``z`` of the router logits, the
    choices ``dropped`` beyond capacity; the load-balancing loss's coefficient ``coef`` and the
    z-loss's ``z_coef`` (0: off)."""

    counts: jax.Array
    probs: jax.Array
    rows: jax.Array
    z: jax.Array
    dropped: jax.Array
    coef: float = static()
    z_coef: float = static(0.0)

    @staticmethod
    def zeros(num_experts: int, coef: float, z_coef: float = 0.0) -> RouterSums:
        empty, nothing = jnp.zeros((num_experts,), jnp.float32), jnp.zeros((), jnp.float32)
        return RouterSums(
            counts=empty, probs=empty, rows=nothing, z=nothing, dropped=nothing, coef=coef,
            z_coef=z_coef,
        )  # fmt: skip

    def add(self, routing: Routing, counted: jax.Array | None) -> RouterSums:
        """These sums plus one layer's ``routing``, each token weighted by ``counted`` (tokens,)
        (None: every token; 0 leaves padding out, as transformers' attention mask does)."""
        probs = routing.probs  # (tokens, experts)
        weight = jnp.ones(probs.shape[:1], jnp.float32) if counted is None else counted
        num_experts = probs.shape[-1]
        picked = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)  # (t, k, e)
        counts = jnp.einsum("tke,t->e", picked, weight)
        return RouterSums(
            counts=self.counts + jax.lax.stop_gradient(counts),
            probs=self.probs + jnp.einsum("te,t->e", probs, weight),
            rows=self.rows + weight.sum(),
            z=self.z + jnp.sum(weight * routing.log_z**2),
            dropped=self.dropped + _dropped(routing, weight),
            coef=self.coef,
            z_coef=self.z_coef,
        )


def _dropped(routing: Routing, weight: jax.Array) -> jax.Array:
    """The choices of the tokens ``weight`` (tokens,) counts that capacity dropped."""
    if routing.kept is None:
        return jnp.zeros((), jnp.float32)
    lost = jnp.sum(~routing.kept, axis=-1).astype(jnp.float32)  # (tokens,)
    return jnp.sum(weight * lost)


def aux_loss(sums: RouterSums, counts: jax.Array, rows: jax.Array) -> jax.Array:
    """The load-balancing loss ``E · Σₑ (countsₑ / rows) · (probsₑ / rows)`` of ``sums``, with
    the ``counts`` and ``rows`` of all the tokens it is taken over (a microbatch's, every replica
    together; equal to ``sums``' own on one device). Linear in ``sums.probs``: the losses of the
    replicas of a microbatch, each with its own probabilities, add up to the microbatch's."""
    num_experts = sums.probs.shape[-1]
    return num_experts * jnp.sum(counts * sums.probs) / (rows * rows)


def z_loss(sums: RouterSums, rows: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean over ``rows`` token rows (every expert layer's) of the
    squared log-partition of the router logits; linear in ``sums.z`` as :func:`aux_loss` is in
    the probabilities."""
    return sums.z / rows


def num_params(num_layers: int, num_experts: int, width: int, mlp_width: int) -> int:
    """The parameters of a stack of expert blocks: router and three matrices per expert."""
    return num_layers * num_experts * width * (1 + 3 * mlp_width)
