"""Configs, jobs, the execution chain, the quick session, data options, resume and plots."""

import json

import numpy as np
import pytest
import yaml
from support import TINY_GPT, GPTTrainerConfig

import theseus
from theseus.config import ConfigError, apply_overrides, load_yaml, save_yaml
from theseus.data import write_tokens
from theseus.execution import Chain, chain, quick
from theseus.jobs import all_jobs, get_job
from theseus.plot import plot_losses
from theseus.sharding.axis import ShardingPolicy
from theseus.training.run.mode import RunMode

TINY = (*TINY_GPT, "training.steps=6", "checkpointing.keep=5")


# --- configs -------------------------------------------------------------------------------


def test_config_yaml_round_trip_and_overrides(tmp_path):
    config = apply_overrides(GPTTrainerConfig(), ["model.n_layer=3", "optimization.b2=0.99"])
    assert config.model.n_layer == 3 and config.optimization.b2 == 0.99
    save_yaml(config, tmp_path / "c.yaml")
    assert load_yaml(GPTTrainerConfig, tmp_path / "c.yaml") == config
    assert "!!python" not in (tmp_path / "c.yaml").read_text()


def test_config_errors_name_key_value_and_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"'training.bogus'.*accepted keys there: batch_size"):
        apply_overrides(GPTTrainerConfig(), ["training.bogus=1"])
    with pytest.raises(ConfigError, match=r"training.batch_size='many'"):
        apply_overrides(GPTTrainerConfig(), ["training.batch_size=many"])
    with pytest.raises(ConfigError, match=r"model.n_layer=2.5"):
        apply_overrides(GPTTrainerConfig(), ["model.n_layer=2.5"])
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides(GPTTrainerConfig(), ["training.batch_size"])
    (tmp_path / "bad.yaml").write_text("training: {batch_size: 4, colour: red}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'training.colour'"):
        load_yaml(GPTTrainerConfig, tmp_path / "bad.yaml")
    (tmp_path / "evil.yaml").write_text("training: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_yaml(GPTTrainerConfig, tmp_path / "evil.yaml")


def test_config_assignment_is_validated():
    config = GPTTrainerConfig()
    config.training.batch_size = 64
    with pytest.raises(ValueError):
        config.training.batch_size = "lots"
    with pytest.raises(ValueError):
        config.model.n_layer = 0


# --- jobs ----------------------------------------------------------------------------------


def test_builtin_jobs_are_registered():
    names = {job.name: job for job in all_jobs()}
    assert names["gpt/train/pretrain"].action == "train"
    assert names["gpt/evaluate"].action == "evaluate"
    with pytest.raises(ValueError, match=r"unknown job 'gpt/nope'.*gpt/train/pretrain"):
        get_job("gpt/nope")


# --- chain ---------------------------------------------------------------------------------


def test_chain_shard_merges_and_is_immutable():
    base = chain("gpt/train/pretrain")
    sharded = base.shard(tp=2).shard(fsdp=True)
    assert (sharded.policy.tp, sharded.policy.zero, sharded.policy.fsdp) == (2, True, True)
    assert base.policy == ShardingPolicy()
    with pytest.raises(ValueError, match="FSDP requires ZeRO"):
        sharded.shard(zero=False)
    with pytest.raises(AttributeError):
        sharded.policy = ShardingPolicy()


def test_chain_yaml_round_trip(tmp_path):
    built = (
        theseus.chain("gpt/train/pretrain", *TINY)
        .shard(tp=2, fsdp=True)
        .then("gpt/evaluate")
        .configure("training.validation_batches=2")
    )
    built.save(tmp_path / "chain.yaml")
    loaded = Chain.load(tmp_path / "chain.yaml")
    assert loaded == built
    data = yaml.safe_load((tmp_path / "chain.yaml").read_text())
    assert data["sharding"] == {
        "tp": 2,
        "zero": True,
        "fsdp": True,
        "activation_checkpointing": "none",
        "experts": "none",
    }
    assert [s["job"] for s in data["steps"]] == ["gpt/train/pretrain", "gpt/evaluate"]
    # The evaluate step starts from the training step's config.
    assert loaded.steps[1].config.model == loaded.steps[0].config.model
    assert loaded.steps[1].config.training.validation_batches == 2


# --- quick session -------------------------------------------------------------------------


def test_quick_session_shard_before_creation(tmp_path):
    with quick("gpt/train/pretrain", tmp_path / "q") as q:
        q.shard(tp=2).shard(fsdp=True)
        q.override(*TINY)
        q.config.training.batch_size = 32
        trainer = q.create()
        assert trainer.policy == ShardingPolicy(tp=2, fsdp=True)
        assert trainer.batch_plan.global_batch_size == 32
        with pytest.raises(ValueError, match="sharding must be configured before job creation"):
            q.shard(tp=4)


def test_quick_session_config_is_frozen_once_the_job_exists(tmp_path):
    """The trainer fixed its batch plan and layouts at creation: a later change would be
    silently ignored, so it is refused, with what to do instead."""
    with quick("gpt/train/pretrain", tmp_path / "q") as q:
        q.override(*TINY)
        q.config.training.steps = 3  # before create(): accepted
        trainer = q.create()
        for section, name, value in (("training", "batch_size", 64), ("model", "n_layer", 3)):
            with pytest.raises(
                ValueError, match=rf"cannot set {section}\.{name} = .*Configure before"
            ):
                setattr(getattr(q.config, section), name, value)
        with pytest.raises(ValueError, match="already created"):
            q.config.logging = q.config.logging
        with pytest.raises(ValueError, match="cannot apply overrides"):
            q.override("training.steps=5")
        assert trainer.config is q.config
        assert (q.config.training.batch_size, q.config.training.steps) == (16, 3)
        copy = apply_overrides(q.config, ["training.steps=4"])  # copies are not frozen
        copy.training.steps = 5
        assert copy.training.steps == 5


def test_quick_session_config_assignment_is_checked_at_once(tmp_path):
    with quick("gpt/train/pretrain", tmp_path / "q") as q:
        q.override(*TINY)
        with pytest.raises(ValueError, match="divisible by n_head=5"):
            q.config.model.n_head = 5  # 32 % 5 != 0
        assert q.create().config.model.n_head == 4


# --- data ----------------------------------------------------------------------------------


def test_trains_on_own_text_and_token_files(tmp_path):
    """Both runs are TINY's model and steps (one program, compiled once); token ids past the
    model's vocabulary are refused with the size they need. (Resuming reproduces the
    uninterrupted losses bit for bit: tests/test_cli.py's SIGKILL/SIGTERM run, and the packed,
    LoRA and preference runs of their files.)"""
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    tokens, wide = tmp_path / "tokens.bin", tmp_path / "wide.bin"
    write_tokens(tokens, np.arange(20_011) % 251, dtype="uint32")  # under the vocabulary's 256
    write_tokens(wide, np.arange(20_011) % 499, dtype="uint32")
    for name, data in (
        ("text", [f"data.path={text}"]),
        ("bin", [f"data.path={tokens}", "data.token_dtype=uint32"]),
    ):
        with quick("gpt/train/pretrain", tmp_path / name) as q:
            q.override(*TINY, *data, "checkpointing.interval=6")  # one save: they cost CPU
            summary = q()
        run = json.loads((tmp_path / name / "run.json").read_text())
        assert str(tmp_path) in run["data"]
        assert np.isfinite(summary.final_loss)
    with quick("gpt/train/pretrain", tmp_path / "small-vocab") as q:
        q.override(*TINY, f"data.path={wide}", "data.token_dtype=uint32")
        with pytest.raises(ValueError, match=r"model\.vocab_size=499"):
            q()


# --- resume --------------------------------------------------------------------------------


def test_run_mode_is_one_object_checked_once(tmp_path):
    """One RunMode travels whole; contradictions are refused when it is made."""
    mode = RunMode(resume=True, allow_changes=True)
    assert quick("gpt/train/pretrain", tmp_path, mode=mode).mode is mode
    assert theseus.RunMode is RunMode
    with pytest.raises(ValueError, match="contradict each other"):
        RunMode(resume=True, overwrite=True)
    with pytest.raises(ValueError, match="applies to --resume only"):
        RunMode(allow_changes=True)
    with pytest.raises(ValueError, match="nothing to resume"):
        RunMode(resume=True).runs_to_replace(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl\)"):
        RunMode().runs_to_replace(tmp_path)
    assert RunMode(overwrite=True).runs_to_replace(tmp_path) == [tmp_path / "metrics.jsonl"]
    assert not (tmp_path / "chain").exists()


# --- plots ---------------------------------------------------------------------------------


def test_plot_writes_png(tmp_path):
    rows = [{"step": s, "tokens": 100 * s, "loss": 5.0 / s} for s in range(1, 11)]
    for row in rows[1:]:  # the throughput panel
        row.update(step_time_s=0.5, tokens_per_s=200.0, mfu=0.4)
    rows[4]["val_loss"] = 1.2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plot_losses(tmp_path)
    assert path == tmp_path / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"no metrics\.jsonl"):
        plot_losses(tmp_path / "missing")
