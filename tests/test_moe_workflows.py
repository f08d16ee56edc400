"""The dense families' workflows on an imported tiny Qwen3-MoE: lm-evaluation-harness scores
(``model="theseus"`` under tp=2 + FSDP with the experts over shard) equal the harness's Hugging
Face backend on the folder, and ``theseus evaluate --tasks --experts shard`` prints them; ``theseus plan
--compile`` compiles the step with the experts placed and its collectives are the exchange the
plan names (all-gathers, no all-to-all). Needs the eval and reference extras."""

import json
import re

import pytest
from hf_reference import Reference
from support import invoke, lm_eval_module
from test_harness import assert_same_results, evaluate, write_tasks

from theseus.hf.importer import import_hf


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm_eval offline, the harness's tiny tasks, the reference folder (its byte tokenizer
    ending text with "|") and its import."""
    root = tmp_path_factory.mktemp("moe_harness")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        patch.setenv("HF_DATASETS_CACHE", str(root / "datasets-cache"))
        lm_eval = lm_eval_module()
        reference = Reference("qwen3_moe", root / "hf")
        settings = {"eos_token": "|", "tokenizer_class": "PreTrainedTokenizerFast"}
        (reference.directory / "tokenizer_config.json").write_text(json.dumps(settings))
        import_hf(reference.directory, root / "run")
        yield lm_eval, write_tasks(root / "tasks"), reference.directory, root / "run"


def test_harness_scores_of_a_moe_run_equal_transformers(harness):
    """Every request of the three tasks (log-likelihoods within 1e-4, greedy generations
    identical) on the run under tp=2 + FSDP with the experts over shard equals the hf backend on
    the folder; the CLI, experts over shard too, prints the harness's table with the same
    accuracy."""
    lm_eval, tasks, folder, run = harness
    backend = {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}
    reference = evaluate(lm_eval, tasks, "hf", backend)
    args = f"run={run},tp=2,fsdp=True,experts=shard"
    assert_same_results(evaluate(lm_eval, tasks, "theseus", args), reference)

    flags = ("--tasks", "tiny_choice", "--include-path", tasks, "--tp", 2, "--experts", "shard")
    result = invoke("evaluate", run, *flags)
    assert result.exit_code == 0, result.output
    (written,) = (run / "harness" / "step0").glob("results_*.json")
    results = json.loads(written.read_text())
    assert "experts=shard" in results["config"]["policy"]
    accuracy = reference["results"]["tiny_choice"]["acc,none"]
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(accuracy, rel=1e-5)
    assert "|tiny_choice|" in result.stdout and f"{accuracy:.4f}" in result.stdout


def test_plan_compile_of_a_moe_step_names_its_exchange():
    """`theseus plan --compile` of Qwen3-MoE with experts over batch: the communication line
    names all-gathers and no all-to-all, and the compiled step has exactly that."""
    model = [
        "model.num_layers=2", "model.hidden_size=48", "model.num_heads=4",
        "model.num_kv_heads=2", "model.num_experts=8", "model.moe_intermediate_size=16",
        "model.vocab_size=256",
    ]  # fmt: skip
    training = ["training.seq_len=16", "training.batch_size=8", "training.per_device_batch_size=2"]
    flags = ("--devices", "8", "--tp", "2", "--experts", "batch", "--compile")
    result = invoke("plan", "qwen3_moe/train/pretrain", *flags, *model, *training)
    assert result.exit_code == 0, result.output
    assert "experts split over batch" in result.stdout and "no all-to-all" in result.stdout
    counts = dict(re.findall(r"^  (all-gather|all-to-all) +(\d+) ", result.stdout, re.MULTILINE))
    assert int(counts["all-gather"]) > 0 and int(counts["all-to-all"]) == 0, result.stdout
