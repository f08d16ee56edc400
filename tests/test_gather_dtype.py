"""FSDP gathers in the compute dtype, reshards after the forward pass and recomputes by policy.

- Casting commutes with gathering: under bfloat16 compute, ``training.gather_dtype=compute``
  trains to the numbers of ``storage`` (GPT under tp=2 + FSDP, a user model without a layer
  scan; Llama gathers the same leaves narrow through the same code); under float32 compute
  nothing is cast.
- The compiled step's all-gathers inside the layer loop move 2-byte elements, its gradient
  reductions stay float32.
- Without activation checkpointing the backward pass gathers each layer again instead of keeping
  it; the recompute policies order by memory and FLOPs.
"""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from flax import nnx
from support import (
    DEFAULT_CODEGEN,
    EQUIVALENCE_LLAMA,
    GPTTrainer,
    Run,
    assert_compute_dtype_gathers,
    assert_gathers_agree,
    assert_reductions_in_float32,
    default_codegen_hlo,
    equivalence_config,
    layer_loop_matrix_gathers,
    run_steps,
    shared_trainer,
)

import theseus
from theseus.accounting.collectives import loop_bodies_with
from theseus.accounting.records import as_json
from theseus.config import Section, apply_overrides
from theseus.model.layers import dense, layer_norm
from theseus.plan import plan, render
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.casting import cast_only_inputs


def gpt_trainer(policy: ShardingPolicy, **training) -> GPTTrainer:
    """GPT (3 layers): 32 examples a step, one microbatch (its default-emitter compile is 10%
    shorter than four's; accumulation is the same in either dtype)."""
    replicas = 8 // policy.tp
    trainer = shared_trainer(equivalence_config(32 // replicas, **training), policy)
    assert trainer.batch_plan.accumulation_steps == 1
    return trainer


def train(policy: ShardingPolicy, **training) -> Run:
    """Three steps of :func:`gpt_trainer`, its compiled step's text kept for the tests that read
    it."""
    trainer = gpt_trainer(policy, **training)
    default_codegen_hlo(trainer)  # for the layer-loop test below; run_steps reuses it
    return run_steps(trainer, compiler_options=DEFAULT_CODEGEN)


#: The layout of the numbers test and the layer-loop test: FSDP's gathers beside tp=2's split
#: (FSDP alone gathers through the same code; one layout's steps, compiled once, serve both).
GATHERING = ShardingPolicy(tp=2, fsdp=True)


def test_compute_dtype_gather_gives_the_numbers_of_a_float32_gather():
    """The same values are rounded, on the shard instead of on the gathered copy: losses and
    parameters of three bfloat16 steps under tp=2 + FSDP agree to 1e-6."""
    policy = GATHERING
    compute = train(policy, dtype="bfloat16", gather_dtype="compute")
    assert_gathers_agree(compute, train(policy, dtype="bfloat16", gather_dtype="storage"))


def test_llama_gathers_in_the_compute_dtype_through_the_same_mechanism():
    """Llama (transposed projections, an untied head gathered before the loss) under FSDP and
    bfloat16: its matrices travel as 16-bit patterns, the head among them, the embedding (read by
    index) not; the numbers of float32 gathers through the same code: the tests above."""
    assert_compute_dtype_gathers(EQUIVALENCE_LLAMA, {"lm_head"})


class ProjectionConfig(Section):
    vocab: int = 256
    width: int = 24
    hidden: int = 40


class Projections(nnx.Module):
    """A user's model without a layer scan whose projections run in bfloat16 through ``dense``
    (the embedding is read in float32: indexed, then cast)."""

    def __init__(self, config: ProjectionConfig, rngs: nnx.Rngs):
        def param(shape, names):
            init = nnx.with_partitioning(nnx.initializers.normal(0.05), names)
            return nnx.Param(init(rngs.params(), shape), eager_sharding=False)

        self.embed = param((config.vocab, config.width), ("symbols", "features"))
        self.up = param((config.width, config.hidden), ("features", "hidden"))
        self.down = param((config.hidden, config.vocab), ("hidden", "symbols"))

    def __call__(self, tokens):  # (examples, seq)
        x = self.embed[...][tokens].astype(jnp.bfloat16)  # (examples, seq, width)
        h = jax.nn.relu(dense(x, self.up[...]))  # (examples, seq, hidden)
        return dense(h, self.down[...], jnp.float32)  # (examples, seq, vocab)


class ProjectionTrainerConfig(theseus.TrainerConfig):
    model: ProjectionConfig = pydantic.Field(default_factory=ProjectionConfig)


class ProjectionTrainer(theseus.BaseTrainer):
    config_class: ClassVar = ProjectionTrainerConfig
    plan: ClassVar = theseus.ShardingPlan(
        tp=[("hidden", "shard")], zero=[("hidden", "batch"), ("symbols", "batch")]
    )

    def build_model(self, rngs):
        return Projections(self.config.model, rngs)

    def default_seq_len(self):
        return 16


def projection_trainer(*overrides):
    common = ["training.batch_size=32", "training.per_device_batch_size=1", "training.steps=10"]
    config = apply_overrides(ProjectionTrainerConfig(), [*common, *overrides])
    return ProjectionTrainer(config, ShardingPolicy(tp=2, fsdp=True))


def test_a_model_without_layer_scan_gathers_its_projections_in_the_compute_dtype():
    """Parameters gathered before the loss: the two projections are read only cast to
    bfloat16, so they are cast before the gather; the embedding is not. Same numbers as float32
    gathers, and nothing cast under float32 compute."""
    trainer = projection_trainer("training.dtype=bfloat16")
    assert trainer.per_layer_paths == set()
    assert trainer.entry.casts == {"up", "down"}
    hlo = trainer.compile().executable.as_text()
    gathers = [line.split("=")[1].split()[0] for line in hlo.splitlines() if " all-gather(" in line]
    assert any(t.startswith("u16[") for t in gathers), gathers  # the projections' bits
    storage = projection_trainer("training.dtype=bfloat16", "training.gather_dtype=storage")
    assert storage.entry.casts == set()
    assert projection_trainer().entry.casts == set()  # float32 compute
    assert_gathers_agree(
        *(run_steps(t, compiler_options=DEFAULT_CODEGEN) for t in (trainer, storage))
    )


def lowered_text(policy, *overrides):
    trainer = GPTTrainer(apply_overrides(equivalence_config(1), list(overrides)), policy)
    batch = jax.ShapeDtypeStruct(
        trainer.batch_plan.shape, np.int32, sharding=trainer.batch_sharding
    )
    return trainer.train_step.lower(trainer.abstract_state, batch).as_text(), trainer


def test_float32_compute_casts_nothing():
    """With float32 compute the gather dtype changes nothing: the same program, no bfloat16."""
    policy = ShardingPolicy(fsdp=True)
    compute, _ = lowered_text(policy, "training.gather_dtype=compute")
    storage, _ = lowered_text(policy, "training.gather_dtype=storage")
    assert compute == storage
    assert "bf16" not in compute


@pytest.mark.parametrize("gather_dtype", ["compute", "storage"])
def test_layer_loop_gathers_move_the_compute_dtype(gather_dtype):
    """bfloat16 compute, tp=2 + FSDP, 3 layers (the program the numbers test above trains,
    compiled once): every matrix gathered in the layer loop travels as 16-bit bit patterns of
    its bfloat16 values (``u16``: XLA:CPU would widen a bfloat16 all-gather to float32); with
    ``gather_dtype=storage`` as float32. Gradients are reduced in float32 either way."""
    trainer = gpt_trainer(GATHERING, dtype="bfloat16", gather_dtype=gather_dtype)
    layers = trainer.config.model.n_layer
    assert layers != trainer.batch_plan.accumulation_steps  # the layer loop's trip count
    hlo = default_codegen_hlo(trainer)
    matrices = layer_loop_matrix_gathers(hlo, layers)
    assert len(matrices) >= 2 * 6, matrices  # 6 matrices, forward and backward
    want = "u16[" if gather_dtype == "compute" else "f32["
    assert all(t.startswith(want) for t in matrices), matrices
    assert_reductions_in_float32(hlo)


def wide_config(num_layers: int):
    """GPT of float32 layers of 1.8 MB, one example per device."""
    overrides = ["model.n_embd=192", "model.n_head=4", "training.batch_size=8"]
    return apply_overrides(equivalence_config(1), [*overrides, f"model.n_layer={num_layers}"])


@functools.cache  # the recompute comparison below reads the same steps from the cache
def wide(policy, num_layers):
    return GPTTrainer(wide_config(num_layers), policy).compile()


GATHERED_LAYER = 12 * 192 * 192 * 4  # one wide layer's matrices, float32


@dataclasses.dataclass(frozen=True)
class LayerGrowth:
    """From 3 to 6 wide layers under a policy: the temporaries each layer adds, and the trip
    counts of the 3-layer step's loops that all-gather."""

    per_layer: float
    gather_trips: list[int]


def layer_growth(policy: ShardingPolicy) -> LayerGrowth:
    shallow, deep = wide(policy, 3), wide(policy, 6)
    trips = [trip for _, trip in loop_bodies_with(shallow.executable.as_text(), "all-gather")]
    return LayerGrowth((deep.temporaries - shallow.temporaries) / 3, trips)


def test_with_full_recompute_fsdp_gathers_one_layer_at_a_time_inside_the_layer_loop():
    """Compile only, FSDP with full recompute, float32 layers of 1.8 MB: from 3 to 6 layers the
    temporaries grow by the saved residual stream and the layers' 1/8 shards of gradient, never
    by a gathered layer; the gather sits in the 3-trip layer loops."""
    growth = layer_growth(ShardingPolicy(fsdp=True, activation_checkpointing="full"))
    residual_per_layer = 1 * wide_config(3).model.block_size * 192 * 4  # (examples, seq, n_embd)
    assert growth.per_layer <= 2 * residual_per_layer + 3 * GATHERED_LAYER / 8 < GATHERED_LAYER
    # Forward, and again in the recomputed backward.
    assert growth.gather_trips.count(3) == 2, growth.gather_trips


def test_without_checkpointing_the_backward_pass_gathers_each_layer_again():
    """Compile only, FSDP without activation checkpointing, float32 layers of 1.8 MB: from 3 to 6
    layers the temporaries grow by the layers' activations and shards, not by a gathered copy of
    each layer (which the backward pass used to keep); the gather runs in the forward and the
    backward loop."""
    growth = layer_growth(ShardingPolicy(fsdp=True))
    # Measured: 0.92 MB per layer (activations, the layer's 1/8 shards of gradient and
    # accumulator); 2.69 MB when the backward pass kept each gathered layer (one layer more).
    assert growth.per_layer < GATHERED_LAYER, (growth.per_layer, GATHERED_LAYER)
    assert growth.gather_trips.count(3) == 2, growth.gather_trips


def test_plan_compares_recompute_policies():
    """`theseus plan --compile`: none, full and dots side by side; dots keeps the weight matmuls'
    outputs, so its FLOPs lie strictly between none's and full's, and its peak too. (none and
    full are the 3-layer steps the tests above compiled.)"""
    cfg = wide_config(3)
    result = plan(GPTTrainer, cfg, ShardingPolicy(fsdp=True), 8, compile=True, alternatives=False)
    options = {o.remat: o for o in result.remat}
    assert list(options) == ["none", "full", "dots"]
    none, full, dots = options["none"], options["full"], options["dots"]
    assert none.dot_flops < dots.dot_flops < full.dot_flops, (none, dots, full)
    assert full.peak < dots.peak < none.peak, (none, dots, full)
    assert none.peak == result.compiled.peak
    text = render(result)
    assert "recompute policies" in text and "dots" in text
    assert as_json(result)["remat_policies"][2]["activation_checkpointing"] == "dots"


def test_cast_analysis_finds_weights_read_only_in_the_compute_dtype():
    """A matmul weight is read only through a cast to bfloat16; a LayerNorm scale is read in
    float32, and an input returned as it is, at full precision: neither may be cast."""

    def layer(weights, x):  # x: (4, 8) float32
        h = layer_norm(x, weights["scale"], weights["bias"], jnp.bfloat16)
        return dense(h, weights["w"], jnp.float32), weights["kept"]

    weights = {
        "bias": jnp.zeros(8),
        "kept": jnp.zeros(3),
        "scale": jnp.ones(8),
        "w": jnp.ones((8, 8)),
    }
    found = cast_only_inputs(layer, (weights, jnp.ones((4, 8))), jnp.bfloat16, [True] * 5)
    assert found == [False, False, False, True, False]
