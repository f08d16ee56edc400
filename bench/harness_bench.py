"""Scoring multiple-choice requests through lm-evaluation-harness: theseus's backend beside the
harness's own Hugging Face backend, on the same CPU, in one process.

Makes a random Llama with transformers (a byte-level tokenizer ending text with
``<|endoftext|>``), imports it with ``theseus import-hf``, and writes a multiple-choice task of
``--requests / 4`` documents of four choices as a harness YAML over a local JSON file (offline).
Each backend is made first (model loaded), then the task is scored twice with
``lm_eval.simple_evaluate``: the first time includes theseus's compilation, the second does not.
Reports the seconds of each, the requests per second, the programs theseus compiled (one per
batch width) and the largest difference of a request's log-likelihood between the two.

    PYTHONPATH=. python bench/harness_bench.py [--requests 1000] [--batch-size 16]

Needs the ``eval`` and ``hf-reference`` extras. Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = [
    "the",
    "a",
    "sky",
    "sea",
    "cat",
    "dog",
    "red",
    "blue",
    "runs",
    "sleeps",
    "over",
    "under",
    "quickly",
    "slowly",
    "big",
    "small",
]


def write_model(folder: Path, *, hidden: int, layers: int, context: int) -> None:
    import tokenizers
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=264,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=context,
        bos_token_id=256,
        eos_token_id=256,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, [])
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def write_task(folder: Path, num_docs: int) -> None:
    rng = random.Random(0)

    def phrase(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    docs = [
        {"question": phrase(6, 24), "choices": [" " + phrase(1, 6) for _ in range(4)], "answer": 0}
        for _ in range(num_docs)
    ]
    (folder / "bench_choice.json").write_text(json.dumps(docs))
    config = {
        "task": "bench_choice",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(folder / "bench_choice.json")}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / "bench_choice.yaml").write_text(json.dumps(config))


def score(lm, manager) -> tuple[float, list[float]]:
    """Seconds of one evaluation of the task, and each request's log-likelihood."""
    import lm_eval

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["bench_choice"], task_manager=manager, bootstrap_iters=0
    )
    seconds = time.perf_counter() - start
    samples = sorted(results["samples"]["bench_choice"], key=lambda s: s["doc_id"])
    return seconds, [r[0][0] for s in samples for r in s["resps"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="harness_bench_"))
    os.environ.setdefault("HF_DATASETS_CACHE", str(root / "datasets"))
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import theseus  # registers the harness's model "theseus"
    from theseus.inference.harness import TheseusLM

    (root / "hf").mkdir()
    write_model(root / "hf", hidden=args.hidden, layers=args.layers, context=args.context)
    (root / "tasks").mkdir()
    write_task(root / "tasks", args.requests // 4)
    theseus.import_hf(root / "hf", root / "run")
    manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
    backends = {
        "hf (torch, float32)": HFLM(
            pretrained=str(root / "hf"), dtype="float32", device="cpu", batch_size=args.batch_size
        ),
        "theseus (1 CPU device)": TheseusLM(str(root / "run"), batch_size=args.batch_size),
    }
    rows, logprobs = [], {}
    for name, lm in backends.items():
        first, logprobs[name] = score(lm, manager)
        second, _ = score(lm, manager)
        programs = lm.scorer.num_programs if isinstance(lm, TheseusLM) else "-"
        rows.append((name, first, second, args.requests / second, programs))
    hf, ours = logprobs.values()
    largest = max(abs(a - b) for a, b in zip(hf, ours, strict=True))
    print(
        f"{args.requests} multiple-choice requests, batch {args.batch_size}, Llama hidden "
        f"{args.hidden} × {args.layers} layers, context {args.context}; {os.cpu_count()} cores"
    )
    print("| backend | first run (s) | second run (s) | requests/s | programs compiled |")
    print("|---|---|---|---|---|")
    for name, first, second, rate, programs in rows:
        print(f"| {name} | {first:.2f} | {second:.2f} | {rate:.0f} | {programs} |")
    print(
        f"theseus / hf speed (second runs): {rows[0][2] / rows[1][2]:.2f}×; largest "
        f"log-likelihood difference {largest:.2e}"
    )


if __name__ == "__main__":
    main()
