"""lm-evaluation-harness on a theseus run, offline: three tasks defined here (multiple choice,
rolling perplexity, generation with stop sequences) over local JSON files, a tiny Llama made with
transformers and a byte tokenizer made here. theseus's backend gives the harness's own Hugging
Face backend's numbers on the export of the same run, under any layout, and `theseus evaluate
--tasks` writes and prints them as the harness does; bad input exits 2 and writes nothing.

Part of the Hugging Face group (tests/conftest.py): torch, transformers and lm_eval load in one
worker; without them the tests skip, except under CI, where they fail."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from hf_reference import COMMON, byte_tokenizer, libraries
from support import invoke, lm_eval_module, read_events, subprocess_env

from theseus.plot import plot_losses

EOT = "<|endoftext|>"
VOCAB = 264  # 256 bytes and the end-of-text token, padded to divide over 8 devices
CONTEXT = 64
# (name, output type, data rows, task settings)
CHOICE_DOCS = [
    {"question": q, "choices": c, "answer": a}
    for q, c, a in [
        ("The sky is", [" blue", " green", " loud"], 0),
        ("Two plus two is", [" four", " five"], 0),
        ("Water is", [" wet", " dry", " sharp", " heavy"], 0),
        ("Fire is", [" hot", " cold"], 0),
        ("A cat says", [" meow", " woof", " moo"], 0),
    ]
]
TEXT_DOCS = [
    {"text": "Beautiful is better than ugly."},
    {"text": "Explicit is better than implicit. Simple is better than complex. " * 3},
    {"text": "Flat is better than nested."},
]
QA_DOCS = [
    {"question": q, "answer": a}
    for q, a in [("Name a color", "blue"), ("Say hi", "hi"), ("Count", "one two"), ("Why", "so")]
]
TASKS = {
    "tiny_choice": (
        CHOICE_DOCS,
        {
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [
                {"metric": m, "aggregation": "mean", "higher_is_better": True}
                for m in ("acc", "acc_norm")
            ],
        },
    ),
    "tiny_text": (
        TEXT_DOCS,
        {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": m, "aggregation": a, "higher_is_better": False}
                for m, a in (
                    ("word_perplexity", "weighted_perplexity"),
                    ("byte_perplexity", "weighted_perplexity"),
                    ("bits_per_byte", "bits_per_byte"),
                )
            ],
        },
    ),
    "tiny_qa": (
        QA_DOCS,
        {
            "output_type": "generate_until",
            "doc_to_text": "Q: {{question}}\nA:",
            "doc_to_target": " {{answer}}",
            "generation_kwargs": {"until": ["\n", "e"], "max_gen_toks": 12, "do_sample": False},
            "metric_list": [
                {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}
            ],
        },
    ),
}


def write_tasks(folder: Path) -> Path:
    """The three tasks as harness YAML files over JSON files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (docs, settings) in TASKS.items():
        data = folder / f"{name}.json"
        data.write_text(json.dumps(docs))
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **settings,
        }
        (folder / f"{name}.yaml").write_text(json.dumps(config))  # YAML reads JSON
    return folder


def write_model(folder: Path) -> Path:
    """A random tiny Llama (the reference models' shape, context ``CONTEXT``) with a byte-level
    tokenizer that ends text with ``EOT``."""
    lib = libraries()
    torch, transformers = lib.torch, lib.transformers
    shape = COMMON | {"vocab_size": VOCAB, "max_position_embeddings": CONTEXT}
    config = transformers.LlamaConfig(**shape, bos_token_id=256, eos_token_id=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens([EOT])
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": EOT, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tasks, the run imported from the tiny model, and the run's export."""
    root = tmp_path_factory.mktemp("harness")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        patch.setenv("HF_DATASETS_CACHE", str(root / "datasets-cache"))
        lm_eval = lm_eval_module()
        source = write_model(root / "source")
        assert invoke("import-hf", source, root / "run").exit_code == 0
        result = invoke("export-hf", root / "run", root / "export")
        assert result.exit_code == 0, result.output
        yield lm_eval, write_tasks(root / "tasks"), root


def evaluate(lm_eval, tasks: Path, model, model_args) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )


def responses(results: dict) -> dict[str, list]:
    """Each task's raw responses, request by request, in document order."""
    return {
        task: [r for sample in sorted(samples, key=lambda s: s["doc_id"]) for r in sample["resps"]]
        for task, samples in results["samples"].items()
    }


def assert_same_results(mine: dict, theirs: dict) -> None:
    """Per request: log-likelihoods within 1e-4, greedy flags and generations identical; the
    tasks' metrics equal (perplexities to the log-likelihoods' tolerance)."""
    ours, reference = responses(mine), responses(theirs)
    assert ours.keys() == reference.keys() == set(TASKS)
    for task in TASKS:
        assert len(ours[task]) == len(reference[task]) > 0, task
        for got, want in zip(ours[task], reference[task], strict=True):
            if task == "tiny_qa":
                assert got == want
            elif task == "tiny_choice":
                (logprob, greedy), (ref_logprob, ref_greedy) = got[0], want[0]
                assert abs(logprob - ref_logprob) < 1e-4 and greedy == ref_greedy
            else:
                assert abs(got[0] - want[0]) < 1e-4
    for task in TASKS:
        got, want = mine["results"][task], theirs["results"][task]
        for metric in [k for k in want if k.endswith(",none") and "stderr" not in k]:
            assert got[metric] == pytest.approx(want[metric], rel=1e-5), (task, metric)


def test_scores_equal_the_harness_hugging_face_backend_on_every_layout(setup):
    """Every task's requests on the export through `model="hf"` (float32) and on the run through
    `model="theseus"`: on one device, and under tp=2 + FSDP on 8 devices; scoring compiles one
    program a batch width."""
    lm_eval, tasks, root = setup
    from theseus.inference.harness import TheseusLM, load_harness_model

    reference = evaluate(
        lm_eval,
        tasks,
        "hf",
        {"pretrained": str(root / "export"), "dtype": "float32", "device": "cpu"},
    )
    one_device = TheseusLM.of(load_harness_model(root / "run", devices=jax.devices()[:1]))
    assert_same_results(evaluate(lm_eval, tasks, one_device, None), reference)
    assert one_device.scorer.num_programs <= len(one_device.scorer.widths) == 2
    sharded = evaluate(lm_eval, tasks, "theseus", f"run={root / 'run'},tp=2,fsdp=True")
    assert (
        sharded["config"]["policy"].startswith("tp=2")
        and "fsdp=True" in sharded["config"]["policy"]
    )
    assert_same_results(sharded, reference)


def test_cli_writes_and_prints_results_as_the_harness_does(setup):
    """`theseus evaluate RUN --tasks ... --include-path DIR --limit N --log-samples --tp 2`
    prints the harness's table and writes its results and samples under RUN/harness/step<N>/."""
    _, tasks, root = setup
    run = root / "run"
    result = invoke(
        "evaluate", run, "--tasks", "tiny_choice,tiny_qa", "--include-path", tasks,
        "--limit", 3, "--log-samples", "--tp", 2,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "|tiny_choice|" in result.stdout and "|exact_match|" in result.stdout
    folder = run / "harness" / "step0"
    (written,) = folder.glob("results_*.json")
    results = json.loads(written.read_text())
    assert results["config"]["policy"].startswith("tp=2")
    assert results["n-samples"]["tiny_choice"] == {"original": 5, "effective": 3}
    for task in ("tiny_choice", "tiny_qa"):
        (samples,) = folder.glob(f"samples_{task}_*.jsonl")
        assert len(samples.read_text().splitlines()) == 3
    for task, metric in (("tiny_choice", "acc,none"), ("tiny_qa", "exact_match,none")):
        assert f"{results['results'][task][metric]:.4f}" in result.stdout


def test_bad_input_is_one_paragraph_and_writes_nothing(setup, tmp_path):
    """An unknown task, a task whose dataset is not available offline, a run without a
    tokenizer and harness options without --tasks: exit 2, one paragraph, nothing written."""
    _, tasks, root = setup
    absent = tmp_path / "absent-tasks"
    absent.mkdir()
    config = {"task": "tiny_absent", "dataset_path": "theseus-tests/absent", "test_split": "test"}
    (absent / "tiny_absent.yaml").write_text(json.dumps(config | TASKS["tiny_qa"][1]))
    bare = tmp_path / "bare"
    shutil.copytree(root / "run", bare, ignore=shutil.ignore_patterns("tokenizer*"))
    run = root / "run"
    before = {folder: sorted(folder.rglob("*")) for folder in (run, bare)}
    cases = [
        ((run, "--tasks", "tiny_choise", "--include-path", tasks), "did you mean tiny_choice"),
        (
            (run, "--tasks", "tiny_absent", "--include-path", absent),
            "task tiny_absent: its dataset",
        ),
        ((bare, "--tasks", "tiny_choice", "--include-path", tasks), "has no tokenizer"),
        ((run, "--limit", 3), "--limit apply to harness tasks"),
        ((run, "--tasks", "tiny_choice", "training.seq_len=8"), "config overrides"),
    ]
    for args, fragment in cases:
        result = invoke("evaluate", *args)
        assert result.exit_code == 2, result.output
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and fragment in errors[0], result.stderr
        assert "Traceback" not in result.output
    assert {folder: sorted(folder.rglob("*")) for folder in (run, bare)} == before


TRAINING = (
    "training.batch_size=8",
    "training.per_device_batch_size=1",
    "training.validation_batches=1",
    "training.validation_interval=2",
    "checkpointing.interval=2",
    "logging.progress_bar=false",
    "finetune.lora_rank=2",
)
PERPLEXITIES = ("bits_per_byte", "byte_perplexity", "word_perplexity")


def train_from(run: Path, out: Path, steps: int, *overrides: str):
    """`theseus train` of the run's model on the built-in corpus for ``steps`` steps."""
    return invoke(
        "train", "--job", "llama/train/pretrain", "--init-from", run, "--out", out,
        "--steps", steps, *TRAINING, *overrides,
    )  # fmt: skip


def scored_settings(tasks: Path) -> tuple[str, ...]:
    """Overrides that score two tasks at every step of a training run."""
    return (
        "evaluation.tasks=[tiny_text,tiny_qa]",
        f"evaluation.include_path={tasks}",
        "evaluation.interval=1",
        "evaluation.limit=3",
        "logging.tensorboard=true",
    )


def run_launch(*argv) -> subprocess.CompletedProcess:
    """`theseus launch -n 2 --cpu-devices-per-process 4 -- ARGV`, offline; it must succeed."""
    launch = [sys.executable, "-m", "theseus", "launch", "-n", 2, "--cpu-devices-per-process", 4]
    env = subprocess_env() | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        list(map(str, [*launch, "--", *argv])),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def two_processes(setup):
    """A LoRA fine-tune scored during training, in two processes of 4 devices under tp=2 +
    FSDP: every process takes part in scoring and decoding."""
    _, tasks, root = setup
    out = root / "two"
    run_launch(
        "train", "--job", "llama/train/pretrain", "--init-from", root / "run", "--out", out,
        "--steps", "2", "--tp", "2", "--fsdp", *TRAINING, *scored_settings(tasks),
    )  # fmt: skip
    return out


def test_task_scores_during_training(setup, two_processes, tmp_path):
    """With evaluation.tasks, each scored step's row of a LoRA fine-tune holds the scores of the
    live parameters (adapters applied), which equal `theseus evaluate --tasks` on that step's
    checkpoint (adapters joined with the base's frozen parameters); the losses are bit-identical
    to a run without them; two processes under tp=2 + FSDP give one process's scores and losses.
    (A failing evaluation is reported and the training goes on: test_long_runs.py, on the loop
    itself.)"""
    _, tasks, root = setup
    result = train_from(root / "run", tmp_path / "scored", 2, *scored_settings(tasks))
    assert result.exit_code == 0, result.output
    plain = train_from(root / "run", tmp_path / "plain", 2)
    assert plain.exit_code == 0, plain.output
    rows, plain_rows, two = (
        [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        for folder in (tmp_path / "scored", tmp_path / "plain", two_processes)
    )
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain_rows]
    for mine, theirs in zip(two, rows, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["tasks"] == pytest.approx(theirs["tasks"], rel=1e-5)
    names = ["tiny_qa/exact_match", *(f"tiny_text/{m}" for m in PERPLEXITIES)]
    assert [sorted(r["tasks"]) for r in rows] == [names] * 2
    assert "tasks" not in plain_rows[-1]
    events = read_events(tmp_path / "scored" / "tensorboard")
    assert events["tasks/tiny_qa/exact_match"].keys() == {1, 2}
    assert plot_losses(tmp_path / "scored").is_file()  # with a panel of the scores
    evaluated = invoke(
        "evaluate", tmp_path / "scored", "--tasks", "tiny_text,tiny_qa", "--include-path", tasks,
        "--limit", 3, "--output-path", tmp_path / "results",
    )  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    (written,) = (tmp_path / "results" / "step2").glob("results_*.json")
    results = json.loads(written.read_text())["results"]
    assert rows[-1]["tasks"] == {
        "tiny_qa/exact_match": results["tiny_qa"]["exact_match,none"],
        **{f"tiny_text/{m}": results["tiny_text"][f"{m},none"] for m in PERPLEXITIES},
    }


def test_evaluate_in_two_processes_equals_one(setup, two_processes, tmp_path):
    """`theseus launch -n 2 -- evaluate RUN --tasks ...` of the run trained in two processes
    under tp=2 + FSDP gives one process's scores (every metric of a multiple-choice and a
    perplexity task) to 1e-6, written once, by process 0, and printed once. (Validation loss and
    a SLURM-style environment: test_multiprocess.py.)"""
    _, tasks, _ = setup
    args = ["--tasks", "tiny_choice,tiny_text", "--include-path", tasks, "--limit", 3]
    one = invoke("evaluate", two_processes, *args, "--output-path", tmp_path / "one")
    assert one.exit_code == 0, one.output
    done = run_launch("evaluate", two_processes, *args, "--output-path", tmp_path / "two")
    (mine,), (theirs,) = ((tmp_path / n / "step2").glob("results_*.json") for n in ("two", "one"))
    mine, theirs = (json.loads(path.read_text()) for path in (mine, theirs))
    assert mine["config"]["policy"].startswith("tp=2") and "fsdp=True" in mine["config"]["policy"]
    figures = {
        (task, metric): value
        for task, values in theirs["results"].items()
        for metric, value in values.items()
        if metric.endswith(",none") and "stderr" not in metric
    }
    assert len(figures) == 5  # acc, acc_norm and three perplexities
    for (task, metric), value in figures.items():
        assert mine["results"][task][metric] == pytest.approx(value, rel=1e-6), (task, metric)
    table = [line for line in done.stdout.splitlines() if "|tiny_choice|" in line]
    written = [line for line in done.stdout.splitlines() if "written: " in line]
    assert [line[:4] for line in table + written] == ["[0] ", "[0] "], done.stdout
    assert "theseus evaluate" in (two_processes / "logs" / "process-1.log").read_text()


def test_generation_settings_the_decoder_lacks_are_refused_by_name():
    """A task's generation_kwargs that theseus's decoder cannot honour (beams) are refused by
    name, never ignored (what the backend passes on after taking until and max_gen_toks)."""
    lm_eval_module()
    from theseus.inference.harness import _sampling

    settings = TASKS["tiny_qa"][1]["generation_kwargs"] | {"num_beams": 2}
    kwargs = {k: v for k, v in settings.items() if k not in ("until", "max_gen_toks")}
    with pytest.raises(ValueError, match="generation settings num_beams are not supported"):
        _sampling(kwargs)
