"""Model families: the registry, the one attention function's mask against a naive reference,
typed weights under their checkpoint names, and Hugging Face dispatch through a family's spec (a
GPT subclass under its own job is GPT-2)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from support import GPT_FAMILY, GPTTrainer, invoke

import theseus
import theseus.jobs
from theseus.hf.config import export_model_type, hf_config, trainer_family
from theseus.jobs import get_job, register_job
from theseus.model.attention import AttentionMask, attention
from theseus.model.lora import LoraSpec, add_adapters
from theseus.model.parts import LayerNorm, RMSNorm, arrays, stacked_projection, weights
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology


def test_families_are_registered_with_their_jobs():
    found = theseus.families()
    assert sorted(found) == ["gemma", "gpt", "llama", "mixtral", "olmo2", "olmoe", "qwen3_moe"]
    for name, family in found.items():
        assert family.name == name
        pretrain, evaluate, preference, rl = family.jobs
        assert family.jobs == (
            f"{name}/train/pretrain",
            f"{name}/evaluate",
            f"{name}/train/preference",
            f"{name}/train/rl",
        )
        assert family.module in theseus.jobs.BUILTIN_FAMILIES
        assert family.module.rpartition(".")[2] == name
        assert all(
            get_job(job).trainer_class is family.trainer_class for job in (pretrain, evaluate)
        )
        for tuned in (preference, rl):
            tuned_trainer = get_job(tuned).trainer_class
            assert issubclass(tuned_trainer, family.trainer_class)
            assert tuned_trainer is not family.trainer_class
    assert [found[n].trainer_class.__name__ for n in ("gpt", "llama", "olmo2", "gemma")] == [
        "GPTTrainer",
        "LlamaTrainer",
        "Olmo2Trainer",
        "GemmaTrainer",
    ]
    listed = invoke("jobs").output
    assert all(job in listed for family in found.values() for job in family.jobs)


def _naive_attention(q, k, v, query_positions, key_positions, segments, window):
    """Attention by loops over rows, heads and queries, in float64."""
    batch, q_len, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(n_heads):
            for i in range(q_len):
                qp, kp = query_positions[b, i], key_positions[b]
                seen = (kp <= qp) & (qp - kp < window)
                if segments is not None:
                    seen &= segments[1][b] == segments[0][b, i]
                scores = k[b, :, h // group] @ q[b, i, h] / np.sqrt(head_dim)
                probs = np.where(seen, np.exp(scores - scores[seen].max()), 0.0)
                out[b, i, h] = probs @ v[b, :, h // group] / probs.sum()
    return out


def test_attention_mask_matches_a_naive_reference():
    """Causal, cached, segment and window masks (the window traced), grouped-query heads."""
    rng = np.random.default_rng(0)
    batch, seq, n_heads, n_kv, head_dim = 2, 7, 4, 2, 8
    q = rng.normal(size=(batch, seq, n_heads, head_dim)).astype(np.float32)
    k, v = (rng.normal(size=(batch, seq, n_kv, head_dim)).astype(np.float32) for _ in "kv")
    positions = np.broadcast_to(np.arange(seq), (batch, seq))
    segments = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])

    def check(mask, query_positions, segments=None, window=seq):
        got = jax.jit(attention)(jnp.asarray(q[:, : query_positions.shape[1]]), k, v, mask)
        expected = _naive_attention(
            q[:, : query_positions.shape[1]], k, v, query_positions, positions, segments, window
        )
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    check(AttentionMask.causal(seq), positions)
    tail = positions[:, 4:] - 4  # queries 0..2 reading a cache of all 7 positions
    check(AttentionMask.cached(jnp.asarray(tail), seq), tail)
    packed = AttentionMask(positions, positions, segments, segments)
    check(packed, positions, (segments, segments))
    windowed = AttentionMask(positions, positions, window=jnp.int32(3))
    check(windowed, positions, window=3)


@weights
class _Pieces:
    io: object
    oi: object
    rms: RMSNorm
    layer: LayerNorm


class _Holder(nnx.Module):
    pieces: _Pieces = nnx.data()

    def __init__(self, rngs):
        def proj(layout, bias):
            return stacked_projection(2, 5, 3, ("a", "b"), layout, bias=bias, std=1.0, rngs=rngs)

        rms = RMSNorm.create((2, 3), ("n_layer", None), 1e-6, rngs=rngs, offset=1.0)
        layer = LayerNorm.create((3,), None, 1e-5, rngs=rngs)
        self.pieces = _Pieces(io=proj("io", True), oi=proj("oi", False), rms=rms, layer=layer)


def test_typed_weights_keep_their_checkpoint_names_and_types():
    """A projection's leaves are named as checkpoints store them (``kernel`` in layout io,
        ``weight`` in oi, ``bias``, ``lora_a``, ``lora_b``), norms' as theirs; a parameter dict
        merges back into the same types, static fields included, and arrays() gives its arrays
    themselves."""

    def build():
        holder = _Holder(nnx.Rngs(0))
        add_adapters(holder, LoraSpec(rank=2, alpha=4.0, targets=("oi",)), rngs=nnx.Rngs(1))
        return holder

    holder = nnx.eval_shape(build)  # shapes only: nothing to compute
    graphdef, state = nnx.split(holder, nnx.Param)
    params = nnx.to_pure_dict(state)
    shapes = jax.tree.map(jnp.shape, params["pieces"])
    assert shapes == {
        "io": {"kernel": (2, 5, 3), "bias": (2, 3)},
        "oi": {"weight": (2, 3, 5), "lora_a": (2, 2, 5), "lora_b": (2, 3, 2)},
        "rms": {"weight": (2, 3)},
        "layer": {"scale": (3,), "bias": (3,)},
    }
    pieces = arrays(nnx.merge(graphdef, params).pieces)
    assert (pieces.io.layout, pieces.io.lora, pieces.oi.layout) == ("io", None, "oi")
    assert (pieces.oi.lora.scale, pieces.rms.offset, pieces.layer.eps) == (2.0, 1.0, 1e-5)
    assert pieces.oi.lora.b is params["pieces"]["oi"]["lora_b"]


def test_a_gpt_subclass_under_its_own_job_is_gpt2(monkeypatch):
    """Hugging Face dispatch follows the trainer's family, not the job's name."""

    class RenamedGPT(GPTTrainer):
        pass

    monkeypatch.setattr(theseus.jobs, "_JOBS", dict(theseus.jobs._JOBS))
    register_job("test/renamed-gpt", RenamedGPT, "a GPT under another job")
    one_device = Topology.new(ShardingPolicy(), jax.devices()[:1])
    trainer = get_job("test/renamed-gpt").trainer_class(
        RenamedGPT.config_class(), ShardingPolicy(), one_device
    )
    family = trainer_family(trainer)
    assert family.name == "gpt"
    model = trainer.config.model.model_dump(mode="json")
    model_type = export_model_type(family, model, None)
    assert model_type == "gpt2"
    config = hf_config(family, model, model_type, "float32")
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_embd"] == 128
    names = [t.name for t in GPT_FAMILY.hf.tensors(model)]
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
