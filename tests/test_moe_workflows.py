"""The dense families' workflows on an imported tiny Qwen3-MoE: lm-evaluation-harness scores
(``model="theseus"`` under tp=2 + FSDP with the experts over shard) equal the harness's Hugging
Face backend on the folder, and ``theseus evaluate --tasks --experts shard`` prints them. Needs the eval and reference
extras."""

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
    printed = re.search(r"^\|tiny_choice\|.*\|acc +\|[^|]*\| *([0-9.]+)\|", result.stdout, re.M)
    assert printed and float(printed.group(1)) == pytest.approx(accuracy, abs=1e-4), result.stdout
