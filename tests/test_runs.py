"""A run knows what it is: its job is recorded; runs saved by the previous release (which
recorded none, and a LoRA run's base as an absolute path of the machine that made it) still
resume, evaluate, generate and export; a LoRA run started with --init-from takes its base's job
and model, moves with its base, finds a base elsewhere with --base and refuses another base."""

import json
import shutil
from pathlib import Path

import jax
import pytest
from support import invoke

import theseus
from theseus.checkpoint.checkpointer import Checkpointer
from theseus.checkpoint.meta import CheckpointMeta, MetadataFile
from theseus.config import CHECKPOINTS, apply_overrides
from theseus.execution import quick
from theseus.inference.logits import load_run
from theseus.jobs import get_job
from theseus.plot import read_metrics
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.run.checkpointing import checkpoint_meta
from theseus.training.run.evaluation import run_config
from theseus.training.run.loop import train
from theseus.training.run.mode import RunMode

PREVIOUS = Path(__file__).parent / "fixtures" / "previous_release"
JOBS = {
    "gpt": "gpt/train/pretrain",
    "llama": "llama/train/pretrain",
    "lora": "llama/train/pretrain",
}


@pytest.fixture
def previous(tmp_path) -> Path:
    """The previous release's runs, copied together to a new folder (tests write into them)."""
    root = tmp_path / "moved"
    shutil.copytree(PREVIOUS, root)
    return root


def newest_meta(run: Path) -> CheckpointMeta:
    """The metadata of the newest checkpoint of ``run``, read from its file."""
    step = max(int(p.name) for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit())
    data = json.loads((run / CHECKPOINTS / str(step) / "meta" / "metadata").read_text())
    return MetadataFile.from_json(data).meta


@pytest.mark.parametrize("name", ["gpt", "llama", "lora"])
def test_previous_release_runs_evaluate_generate_export_and_resume(previous, tmp_path, name):
    """Without a recorded job, a run's job follows the legacy rule (its model section); read on
    1 device (trained on 2), it evaluates to its own final validation loss, generates and
    exports; resumed on 2 devices, it continues from step 4 and records its job."""
    run, one = previous / name, jax.devices()[:1]
    saved = newest_meta(run)
    assert saved.job is None and "job" not in json.loads((run / "run.json").read_text())
    if saved.base is not None:  # recorded on the machine that made it: found beside the run
        assert Path(saved.base["run_dir"]).is_absolute()
        assert not Path(saved.base["run_dir"]).exists(), "the base must be found beside the run"
    evaluation = theseus.evaluate(run, devices=one)
    assert evaluation.job == JOBS[name] and evaluation.step == 4
    assert evaluation.val_loss == pytest.approx(read_metrics(run)[-1]["val_loss"], rel=1e-5)
    generated = theseus.generate(run, ["Si"], max_new_tokens=2, devices=one)
    assert len(generated.completions[0].token_ids) == 2
    theseus.export_hf(run, tmp_path / "hf", devices=one)
    assert (tmp_path / "hf" / "config.json").is_file()

    trainer_class = get_job(JOBS[name]).trainer_class
    config = apply_overrides(run_config(trainer_class.config_class, run), ["training.steps=6"])
    policy = ShardingPolicy(**json.loads((run / "run.json").read_text())["policy"])
    trainer = trainer_class(config, policy, Topology.new(policy, jax.devices()[:2]))
    summary = train(trainer, run, mode=RunMode(resume=True))
    assert summary.first_step == 5 and newest_meta(run).job == JOBS[name]
    assert json.loads((run / "run.json").read_text())["job"] == JOBS[name]


def test_lora_run_takes_its_base_moves_with_it_and_checks_it(previous, tmp_path):
    """The README's LoRA example: --init-from a run with no model override and no --job trains
    (the base's job and model), naming its job in run.json and its checkpoints, its base
    recorded relative to it; a contradicting model override is refused naming both values.
    Copied together elsewhere (originals removed) the two still generate and export; with the
    base elsewhere, --base finds it, and a different base is refused by its fingerprints; --base
    for a run without a base is refused."""
    base, lora = tmp_path / "a" / "llama", tmp_path / "a" / "lora"
    shutil.copytree(previous / "llama", base)
    batch = ("training.batch_size=8", "training.per_device_batch_size=1", "--no-zero")
    result = invoke(
        "train", "--init-from", base, "finetune.lora_rank=2", *batch, "--steps", 1,
        "logging.progress_bar=false", "--out", lora,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((lora / "run.json").read_text())["job"] == "llama/train/pretrain"
    meta = newest_meta(lora)
    assert meta.job == "llama/train/pretrain" and meta.base["run_dir"] == "../llama"
    refused = invoke(
        "train", "--job", "llama/train/pretrain", "--init-from", base, "finetune.lora_rank=2",
        "model.hidden_size=12", "--out", tmp_path / "refused",
    )  # fmt: skip
    assert refused.exit_code == 2 and not (tmp_path / "refused").exists()
    assert "model.hidden_size=12 (the base's: 10)" in refused.output
    with quick("llama/train/pretrain", tmp_path / "x", mode=RunMode(init_from=base)) as q:
        q.shard(zero=False).override("finetune.lora_rank=2", *batch[:2])
        assert q.create().config.model.hidden_size == 10

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    moved = tmp_path / "b" / "lora"
    result = invoke("export-hf", moved, tmp_path / "hf")
    assert result.exit_code == 0, result.output
    before = theseus.generate(moved, ["Si"], max_new_tokens=2, temperature=0)

    elsewhere = tmp_path / "c" / "base"
    shutil.move(tmp_path / "b" / "llama", elsewhere)
    lost = invoke("generate", moved, "--prompt", "Si")
    assert lost.exit_code == 2 and "--base DIR" in lost.output, lost.output
    found = invoke(
        "generate", moved, "--prompt", "Si", "--max-new-tokens", 2, "--temperature", 0,
        "--base", elsewhere, "--json",
    )  # fmt: skip
    assert found.exit_code == 0, found.output
    completion = json.loads(found.stdout)["completions"][0]
    assert completion["token_ids"] == before.completions[0].token_ids

    other = tmp_path / "other"  # a base of the same shapes, other values: the base's plus 1
    loaded = load_run(elsewhere, layout="storage")
    with Checkpointer(other / CHECKPOINTS) as checkpoints:
        meta = checkpoint_meta(loaded.trainer, step=4, data_position=0)
        checkpoints.save({"params": jax.tree.map(lambda p: p + 1, loaded.params)}, meta)
        checkpoints.wait()
    with pytest.raises(ValueError, match="are not those this run was trained on") as refusal:
        load_run(moved, base=other)
    assert "--base DIR" in str(refusal.value) and "\n" not in str(refusal.value)
    with pytest.raises(ValueError, match="has no base; drop --base"):  # not silently ignored
        load_run(elsewhere, base=moved)


def test_resume_without_a_job_continues_the_runs_own(previous, tmp_path):
    """--resume without --job takes the job the run records (or the legacy rule), as reading a
    run does: a Llama run is not resumed as the default GPT (a shape mismatch per tensor)."""
    with quick(None, previous / "llama", mode=RunMode(resume=True)) as q:
        assert q.job.name == "llama/train/pretrain"
    empty = invoke("train", "--resume", "--out", tmp_path / "none")
    assert empty.exit_code == 2 and "nothing to resume" in empty.output, empty.output
    assert not (tmp_path / "none").exists()


def test_evaluate_where_the_runs_per_device_batch_does_not_split_its_batch(previous):
    """A run trained on 2 devices (batch 4, 2 per device) evaluates on 4 devices, where 2 per
    device does not split its batch over 4 replicas: a per-device batch that does is derived,
    and the loss is the run's own (the held-out examples do not depend on the split)."""
    run = previous / "gpt"
    evaluation = theseus.evaluate(run, devices=jax.devices()[:4])
    assert evaluation.val_loss == pytest.approx(read_metrics(run)[-1]["val_loss"], rel=1e-5)
