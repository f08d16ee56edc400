"""A user's own NNX model (not GPT), with its own logical names, plan and dropout, registered as
a job and trained through quick() under {tp=2, fsdp} with the losses of one device: one that
gathers all its parameters at once, and one whose stacked layers run through theseus.scan_layers
and are gathered one layer at a time."""

import json
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from flax import nnx

import theseus
from theseus.config import Section, apply_overrides
from theseus.plan import plan, render
from theseus.plot import read_metrics
from theseus.sharding.topology import Topology
from theseus.training.run.loop import train


class BigramConfig(Section):
    vocab: int = 256
    width: int = 24
    hidden: int = 40
    dropout: float = 0.2


class BigramMLP(nnx.Module):
    """Predicts the next byte from the current one: embed, one hidden layer, project back."""

    def __init__(self, config: BigramConfig, rngs: nnx.Rngs):
        def param(shape, names):
            init = nnx.with_partitioning(nnx.initializers.normal(0.05), names)
            return nnx.Param(init(rngs.params(), shape), eager_sharding=False)

        self.embed = param((config.vocab, config.width), ("symbols", "features"))
        self.up = param((config.width, config.hidden), ("features", "hidden"))
        self.up_bias = nnx.Param(jnp.zeros((config.hidden,)))  # unannotated: replicated
        self.down = param((config.hidden, config.vocab), ("hidden", "symbols"))
        self.dropout = nnx.Dropout(config.dropout)

    def __call__(self, tokens, keys, *, train):
        return self.head(self.embed[...][tokens], keys, train)

    def head(self, x, keys, train):
        """Hidden layer with dropout, projected back: (examples, seq, width) -> (..., vocab)."""
        h = jax.nn.relu(x @ self.up[...] + self.up_bias[...])  # (examples, seq, hidden)
        # One key per example: each example's mask is the same under every layout.
        h = jax.vmap(lambda h, key: self.dropout(h, deterministic=not train, rngs=key))(h, keys)
        return h @ self.down[...]  # (examples, seq, vocab)


class BigramTrainerConfig(theseus.TrainerConfig):
    model: BigramConfig = pydantic.Field(default_factory=BigramConfig)


@theseus.register("bigram/train", "a bigram MLP on bytes (test model)")
class BigramTrainer(theseus.BaseTrainer):
    config_class: ClassVar = BigramTrainerConfig
    plan: ClassVar = theseus.ShardingPlan(
        tp=[("hidden", "shard"), ("features", None)],
        zero=[("hidden", "batch"), ("symbols", "batch")],
    )

    def build_model(self, rngs):
        return BigramMLP(self.config.model, rngs)

    def loss(self, model, tokens, keys, *, train):
        logits = model(tokens[:, :-1], keys.examples, train=train)
        return theseus.next_token_loss(logits, tokens[:, 1:])

    def default_seq_len(self):
        return 16


class StackedBigram(BigramMLP):
    """The bigram MLP with ``depth`` residual layers stacked along ``layers`` and scanned with
    theseus.scan_layers (each gathered to the compute layout inside the scan under FSDP)."""

    depth = 3

    def __init__(self, config: BigramConfig, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        init = nnx.with_partitioning(
            nnx.initializers.normal(0.05), ("layers", "features", "hidden")
        )
        shape = (self.depth, config.width, config.hidden)
        self.mix = nnx.Param(init(rngs.params(), shape), eager_sharding=False)

    def __call__(self, tokens, keys, *, train):
        x = self.embed[...][tokens]  # (examples, seq, width)

        def layer(mix, x):  # mix: (width, hidden), one layer's slice
            return x + jnp.tanh(x @ mix) @ mix.T  # (examples, seq, width)

        return self.head(theseus.scan_layers(layer, x, self.mix), keys, train)


@theseus.register("bigram/stacked", "a bigram MLP with stacked, scanned layers (test model)")
class StackedTrainer(BigramTrainer):
    def build_model(self, rngs):
        return StackedBigram(self.config.model, rngs)


OVERRIDES = (
    "training.batch_size=16",
    "training.per_device_batch_size=2",
    "training.steps=4",
    "training.validation_interval=2",
    "training.validation_batches=1",
    "optimization.learning_rate=1e-3",
    "optimization.warmup_steps=1",
    "logging.progress_bar=false",
)


def losses(run_dir):
    rows = read_metrics(run_dir)
    return np.array([r["loss"] for r in rows]), [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.mark.parametrize("job", ["bigram/train", "bigram/stacked"])
def test_own_model_trains_sharded_like_one_device(tmp_path, job):
    assert job in {job.name for job in theseus.jobs.all_jobs()}
    with theseus.quick(job, tmp_path / "sharded") as q:
        q.shard(tp=2, fsdp=True)
        q.override(*OVERRIDES)
        trainer = q.create()
        layouts = trainer.layouts
        assert layouts.storage["up"].spec == jax.sharding.PartitionSpec(None, ("shard", "batch"))
        assert layouts.storage["embed"].spec == jax.sharding.PartitionSpec("batch", None)
        assert layouts.storage["up_bias"].spec == jax.sharding.PartitionSpec()
        gathering = plan(type(trainer), trainer.config, trainer.policy, 8, alternatives=False)
        if job == "bigram/stacked":
            assert trainer.per_layer_paths == {"mix"}
            assert "gathers 1 stacked tensors one layer at a time" in render(gathering)
        else:
            assert trainer.per_layer_paths == set()
            assert "BigramTrainer gathers all parameters at once" in render(gathering)
        q()

    config = apply_overrides(BigramTrainerConfig(), OVERRIDES)
    policy = theseus.ShardingPolicy()
    one_device = type(trainer)(config, policy, Topology.new(policy, devices=jax.devices()[:1]))
    train(one_device, tmp_path / "single")

    sharded_losses, sharded_val = losses(tmp_path / "sharded")
    single_losses, single_val = losses(tmp_path / "single")
    np.testing.assert_allclose(sharded_losses, single_losses, rtol=1e-5)
    np.testing.assert_allclose(sharded_val, single_val, rtol=1e-5)
    assert sharded_losses[-1] < sharded_losses[0]
    # No flops_per_token(): XLA counts the FLOPs, 6 per token and multiply-add of a weight (up
    # and down projections; each scanned layer uses `mix` twice), and a little for the rest.
    run = json.loads((tmp_path / "sharded" / "run.json").read_text())
    assert run["flops_counted_by"].startswith("XLA cost_analysis()")
    layers = StackedBigram.depth if job == "bigram/stacked" else 0
    matmul_flops = 6 * (24 * 40 + 40 * 256 + layers * 2 * 24 * 40)
    assert matmul_flops <= run["flops_per_token"] <= 1.1 * matmul_flops
