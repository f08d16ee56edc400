"""Weighted mixtures of sources: draws follow the weights and depend only on (seed, index); a
two-source mixture trains under tp=2 + FSDP on 8 devices to the numbers of one device, with each
source's validation loss; bad sources exit 2. (SIGKILL and SIGTERM of a mixture run, resumed bit for
bit: tests/test_cli.py.)"""

import json

import jax
import numpy as np
import pytest
from support import TINY_GPT, GPTTrainer, GPTTrainerConfig, invoke, read_events, write_mixture

from theseus.config import DataConfig, apply_overrides, validate
from theseus.data import MixtureSampler, Sampler, load_mixture
from theseus.plot import plot_losses, read_metrics, source_names
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.run.loop import train
from theseus.training.run.metrics import strict_json_row
from theseus.training.run.tensorboard import TensorBoardWriter

WEIGHTS = (0.7, 0.3)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two byte sources of different text: JSON Lines documents and a plain text file."""
    return write_mixture(tmp_path_factory.mktemp("mixture"), WEIGHTS)


def windows(*splits, seed):
    return [Sampler(tokens, 7, seed) for tokens in splits]


def test_draws_follow_the_weights_and_depend_only_on_seed_and_index():
    a = np.arange(1000, dtype=np.uint16)  # (1000,)
    b = np.arange(5000, 6997, dtype=np.uint16)  # (1997,)
    sampler = MixtureSampler(windows(a, b, seed=3), np.asarray(WEIGHTS), seed=3)
    sources = sampler.sources(np.arange(1000 * 16))  # 1,000 steps of 16 examples
    for number, weight in enumerate(WEIGHTS):
        assert abs(np.mean(sources == number) - weight) < 0.02
    batch = sampler.global_batch(64, 4, 4)  # (accumulation, examples, seq_len + 1)
    assert ((batch[..., 0] >= 5000) == (sources[64:80].reshape(4, 4) == 1)).all()
    # Any split of the batch into rows (replicas, processes) reads the same examples.
    np.testing.assert_array_equal(sampler.local_batch(64, 4, 4, np.array([1, 3])), batch[:, [1, 3]])
    np.testing.assert_array_equal(
        sampler.global_batch(64, 2, 8).reshape(16, 8), batch.reshape(16, 8)
    )
    again = MixtureSampler(windows(a, b, seed=3), np.asarray(WEIGHTS), seed=3)
    np.testing.assert_array_equal(again.global_batch(64, 4, 4), batch)
    other = MixtureSampler(windows(a, b, seed=4), np.asarray(WEIGHTS), seed=4)
    assert (other.sources(np.arange(64)) != sources[:64]).any()


def test_sources_from_the_command_line_and_yaml():
    given = validate(DataConfig, {"sources": "data/web:2,books.jsonl:1"})
    assert [(s.path, s.weight, s.name) for s in given.sources] == [
        ("data/web", 2.0, "web"),
        ("books.jsonl", 1.0, "books.jsonl"),
    ]
    listed = [{"path": "a", "weight": 0.5, "name": "wiki"}, {"path": "b/c", "weight": 0.5}]
    assert [s.name for s in validate(DataConfig, {"sources": listed}).sources] == ["wiki", "c"]


def config(sources: str, per_device_batch_size: int) -> GPTTrainerConfig:
    overrides = [*TINY_GPT, f"data.sources={sources}", "training.steps=4"]
    overrides.append(f"training.per_device_batch_size={per_device_batch_size}")
    return apply_overrides(GPTTrainerConfig(), overrides)


def rows(run_dir):
    return read_metrics(run_dir)


def test_mixture_under_tp2_fsdp_matches_one_device(sources, tmp_path):
    one = Topology.new(ShardingPolicy(), devices=jax.devices()[:1])
    reference = GPTTrainer(config(sources, 16), ShardingPolicy(), one)
    sharded = GPTTrainer(config(sources, 2), ShardingPolicy(tp=2, fsdp=True))
    assert sharded.batch_plan.accumulation_steps == 2 and sharded.topology.num_devices == 8
    for trainer, name in ((reference, "one"), (sharded, "eight")):
        train(trainer, tmp_path / name)
    want, got = rows(tmp_path / "one"), rows(tmp_path / "eight")
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
    validated = [r for r in want if "val_loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    for mine, theirs in zip([r for r in got if "val_loss" in r], validated, strict=True):
        assert set(theirs["val_loss_by_source"]) == {"notes.jsonl", "fox.txt"}
        for name, loss in theirs["val_loss_by_source"].items():
            np.testing.assert_allclose(mine["val_loss_by_source"][name], loss, rtol=1e-5)
        weighted = sum(
            w * theirs["val_loss_by_source"][n]
            for w, n in zip(WEIGHTS, ("notes.jsonl", "fox.txt"), strict=True)
        )
        np.testing.assert_allclose(theirs["val_loss"], weighted, rtol=1e-6)
        np.testing.assert_allclose(mine["val_loss"], theirs["val_loss"], rtol=1e-5)


def test_bad_sources_exit_2_and_write_nothing(sources, tmp_path):
    first, second = (item.rpartition(":")[0] for item in sources.split(","))
    for given, fragment in [
        (f"{first}:0,{second}:1", "greater than 0"),
        (f"{first}:-1,{second}:1", "greater than 0"),
        (f"{first}:0.5,{tmp_path / 'missing.jsonl'}:0.5", "'missing.jsonl'"),
        (f"{first}:0.5,{first}:0.5", "repeat"),
    ]:
        out = tmp_path / "run"
        result = invoke("train", f"data.sources={given}", *TINY_GPT, "--out", out)
        assert result.exit_code == 2 and fragment in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
        assert not out.exists()


def test_per_source_losses_reach_tensorboard_the_plot_and_strict_json(tmp_path):
    rows = [{"step": s, "tokens": 16 * s, "loss": 5.0 / s} for s in (1, 2, 3, 4)]
    for row in rows[1::2]:
        row["val_loss"] = 4.0 / row["step"]
        row["val_loss_by_source"] = {"web": 3.0 / row["step"], "books": 5.0 / row["step"]}
    with TensorBoardWriter(tmp_path, {}) as writer:
        for row in rows:
            writer.write(row)
    events = read_events(tmp_path / "tensorboard")
    assert events["val_loss_by_source/books"] == pytest.approx({2: 2.5, 4: 1.25})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert source_names(rows) == ["web", "books"]
    assert plot_losses(tmp_path).read_bytes()[:4] == b"\x89PNG"
    row = {"val_loss": float("nan"), "val_loss_by_source": {"web": float("inf"), "books": 1.0}}
    assert strict_json_row(row) == {
        "val_loss": None,
        "val_loss_by_source": {"web": None, "books": 1.0},
    }


def test_mixture_fingerprint_is_flat_small_integers(sources):
    """Processes compare it with check_same_everywhere, which all-gathers integers."""
    mixture = load_mixture(validate(DataConfig, {"sources": sources}))
    facts = mixture.fingerprint()
    assert {key.split(": ")[0] for key in facts} == {"notes.jsonl", "fox.txt"}
    assert all(type(value) is int for value in facts.values())
    single = load_mixture(validate(DataConfig, {"path": sources.split(",")[1].rpartition(":")[0]}))
    assert single.fingerprint() == single.sources[0].corpus.fingerprint()
