"""Run directories made by `import-hf`, without torch: a tiny Llama trained here is exported with
theseus's own exporter, and that Hugging Face folder is imported again. Evaluating a run takes the
run's own config; the import in two processes gives the one-process import's parameters."""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from support import invoke, subprocess_env

from theseus.config import read_yaml
from theseus.execution import quick
from theseus.inference.logits import load_run, logits
from theseus.plot import read_metrics
from theseus.sharding.layout import path_str

# A Llama whose KV width (16) and MLP (40) divide over 8 devices; bytes are its tokens.
LLAMA = (
    "model.vocab_size=256",
    "model.hidden_size=32",
    "model.intermediate_size=40",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.max_position_embeddings=16",
    "logging.progress_bar=false",
)
TIMEOUT_S = 120
# The evaluation batch of the trained run (an imported run has the job's default batch).
BATCH = (
    "training.batch_size=8",
    "training.per_device_batch_size=1",
    "training.validation_batches=1",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A trained run, its export (a Hugging Face folder) and that folder imported under FSDP."""
    root = tmp_path_factory.mktemp("hf-runs")
    steps = ("--steps", 2, "training.validation_interval=2", "checkpointing.interval=2")
    result = invoke(
        "train", "--job", "llama/train/pretrain", "--fsdp", *LLAMA, *BATCH, *steps,
        "--out", root / "trained",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = invoke("export-hf", root / "trained", root / "hf")
    assert result.exit_code == 0, result.output
    result = invoke("import-hf", root / "hf", root / "imported", "--fsdp")
    assert result.exit_code == 0, result.output
    return root


def test_evaluate_takes_the_model_from_the_run(runs):
    """`theseus train --job llama/evaluate --out RUN` needs no model overrides, for a trained and
    an imported run, and prints its result once; `theseus evaluate RUN` needs no job either (the
    run names it); a model the user forces is refused, naming the fields, before restoring."""
    final_val_loss = read_metrics(runs / "trained")[-1]["val_loss"]
    for run, extra in ((runs / "trained", ()), (runs / "imported", BATCH)):
        result = invoke("train", "--job", "llama/evaluate", "--fsdp", "--out", run, *extra)
        assert result.exit_code == 0, result.output
        assert result.output.count("validation loss") == 1, result.output
        evaluation = json.loads((run / "eval.json").read_text())
        assert evaluation["val_loss"] == pytest.approx(final_val_loss, rel=1e-5)
    for run in (runs / "trained", runs / "imported"):
        assert json.loads((run / "run.json").read_text())["job"] == "llama/train/pretrain"
    result = invoke("evaluate", runs / "imported", *BATCH)
    assert result.exit_code == 0, result.output
    assert "(llama/train/pretrain, tp=1 zero=True fsdp=True" in result.stdout
    evaluation = json.loads((runs / "imported" / "eval.json").read_text())
    assert evaluation["val_loss"] == pytest.approx(final_val_loss, rel=1e-5)
    forced = invoke(
        "train", "--job", "llama/evaluate", "--out", runs / "imported", *BATCH,
        "model.hidden_size=48", "model.rope_theta=500.0",
    )  # fmt: skip
    assert forced.exit_code == 2
    assert "model.hidden_size=48 (the run's: 32); model.rope_theta=500.0" in forced.output
    other = invoke("train", "--job", "gpt/evaluate", "--out", runs / "imported", *BATCH)
    assert other.exit_code == 2 and "not a run of this job's model family" in other.output
    for result in (forced, other):
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_train_hf_starts_a_fresh_model_of_the_configs_shape(runs):
    """`theseus train --hf FOLDER` takes the model section from config.json (no weights), the
    job from its family; overrides apply on top; another family's job is refused."""
    steps = ("--steps", 1, "logging.progress_bar=false", "model.rope_theta=5000.0")
    result = invoke("train", "--hf", runs / "hf", "--fsdp", *BATCH, *steps, "--out", runs / "fresh")
    assert result.exit_code == 0, result.output
    fresh, trained = (
        read_yaml(runs / name / "config.yaml")["model"] for name in ("fresh", "trained")
    )
    assert fresh == trained | {"rope_theta": 5000.0, "head_dim": 8}
    wrong = invoke("train", "--hf", runs / "hf", "--job", "gpt/train/pretrain", "--out", runs / "x")
    assert wrong.exit_code == 2 and "the llama family" in wrong.output
    assert not (runs / "x").exists()


def test_import_in_two_processes_gives_the_one_process_parameters(runs, tmp_path):
    """`theseus launch -n 2 -- import-hf` (2 processes × 4 CPU devices, FSDP): each process
    places only its devices' shards, and the checkpoint is bit-identical to the one-process
    import's (8 devices, FSDP)."""
    out = tmp_path / "two-processes"
    launch = ("launch", "-n", 2, "--cpu-devices-per-process", 4, "--")
    argv = [sys.executable, "-m", "theseus", *map(str, launch), "import-hf", runs / "hf", out]
    result = subprocess.run(
        [*map(str, argv), "--fsdp"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[1] imported llama" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "logs",
        "run.json",
    ]
    one, two = (load_run(run, layout="storage") for run in (runs / "imported", out))
    assert (one.meta.num_processes, two.meta.num_processes) == (1, 2)
    assert one.meta.config == two.meta.config
    names = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(one.params)[0]]
    for name, mine, theirs in zip(
        names, jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True
    ):
        assert np.array_equal(np.asarray(mine), np.asarray(theirs)), name


def test_mistral_sliding_window_is_applied_past_its_length(runs, tmp_path):
    """Mistral's `sliding_window` travels into the run's model config (and back out on export);
    a run four times the window evaluates, and it is applied: with 2 layers of window 4, token 0
    reaches positions up to 6 and no further."""
    hf = tmp_path / "mistral"
    shutil.copytree(runs / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    config |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (hf / "config.json").write_text(json.dumps(config | {"sliding_window": 4}))
    run = tmp_path / "run"
    assert invoke("import-hf", hf, run, "--fsdp").exit_code == 0
    longer = invoke("train", "--job", "llama/evaluate", "--out", run, *BATCH, "training.seq_len=16")
    assert longer.exit_code == 0, longer.output
    with quick("llama/evaluate", run) as session:  # the Python API takes the run's config too
        assert session.config.model.sliding_window == 4
        assert session.override(*BATCH).create().seq_len == 16  # the context, not the window
    ids = np.arange(16)[None] + np.array([[0], [1]])  # (2, 16): rows differ at every position
    ids[1, 1:] = ids[0, 1:]  # now only at position 0
    scores = logits(run, ids)  # (2, 16, vocab)
    reached = np.abs(scores[0] - scores[1]).max(axis=-1) > 0  # (16,)
    assert reached.tolist() == [True] * 7 + [False] * 9
    assert invoke("export-hf", run, tmp_path / "out").exit_code == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["model_type"], exported["sliding_window"]) == ("mistral", 4)
