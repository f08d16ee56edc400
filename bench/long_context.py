"""Long context end to end: a 2-layer Llama (hidden 256, 4 heads) trains 2 steps at
``training.seq_len``, its run is evaluated, and ``theseus generate`` continues a long prompt, each
on one CPU device in its own process, with that process's peak resident memory.

    PYTHONPATH=. python bench/long_context.py [--seq-len 32768] [--prompt-len 16000]
        [--data text|chat] [--rope llama3|linear] [--work DIR]

``--data text`` trains on the built-in corpus (byte tokens); ``--data chat`` on packed chat rows
(conversations cut from the same source, a ChatML template and a byte-level BPE of 8,192 tokens
made here as bench/chat_bench.py makes them, packed into rows of ``seq_len + 1`` tokens, each
attending within its conversation at restarted positions). The rotary frequencies are scaled
(``llama3``: Llama 3.1's scaling from an original context of ``seq_len / 8``; ``linear``: divided
by 8) and ``max_position_embeddings`` is ``seq_len``. The prompt is ``--prompt-len`` token ids
drawn from the vocabulary, 8 new tokens.

The issue's goal (#36, item 5) is a peak of at most 20 GB at 32,768 tokens; that needs the
blockwise attention kernel (the dense XLA attention materialises seq_len² float32 scores per
head). Prints one table; exits 1 when a phase fails or goes over ``--limit-gb``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from chat_bench import CHATML, make_corpus, make_tokenizer  # noqa: E402

THESEUS = [sys.executable, "-m", "theseus"]
MODEL = [
    "model.hidden_size=256",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.num_layers=2",
    "model.intermediate_size=704",
]


def run(command: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak resident GB, stdout) of ``command``; its output goes on to ours."""
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - began
    print(stdout[-2000:], flush=True)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(command)}")
    return wall, usage.ru_maxrss / 2**20, stdout  # ru_maxrss is in KiB on Linux


def chat_data(work: Path, seq_len: int) -> tuple[str, int]:
    """A tokenized chat corpus in ``work`` (about 2.5 rows of ``seq_len`` tokens per MB) and
    its vocabulary size."""
    corpus, folder, tokens = work / "chat.jsonl", work / "tokenizer", work / "chat_tokens"
    make_corpus(corpus, max(2, seq_len // 4096))
    make_tokenizer(folder, corpus, CHATML)
    run([*THESEUS, "tokenize", str(corpus), str(tokens), "--tokenizer", str(folder)])
    return f"data.path={tokens}", 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--prompt-len", type=int, default=16000)
    parser.add_argument("--data", choices=("text", "chat"), default="text")
    parser.add_argument("--rope", choices=("llama3", "linear"), default="llama3")
    parser.add_argument("--limit-gb", type=float, default=20.0)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="long-context-"))
    work.mkdir(parents=True, exist_ok=True)
    data, vocab = chat_data(work, args.seq_len) if args.data == "chat" else ("", 256)
    rope = [f"model.rope_type={args.rope}", "model.rope_factor=8.0"]
    if args.rope == "llama3":
        rope.append(f"model.rope_original_max_position_embeddings={args.seq_len // 8}")
    out = work / "run"
    settings = [
        *MODEL,
        *rope,
        f"model.vocab_size={vocab}",
        f"model.max_position_embeddings={args.seq_len}",
        f"training.seq_len={args.seq_len}",
        "training.batch_size=1",
        "training.per_device_batch_size=1",
        "training.steps=2",
        "training.validation_batches=1",
        *([data] if data else []),
    ]
    one_device = ["--cpu-devices", "1", "--out", str(out)]
    job = ["--job", "llama/train/pretrain"]
    phases = {"train 2 steps": [*THESEUS, "train", *job, *one_device, *settings]}
    phases["evaluate"] = [*THESEUS, "train", "--job", "llama/evaluate", *one_device]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_len).tolist()
    phases[f"generate 8 after {args.prompt_len:,}"] = [
        *THESEUS,
        "generate",
        str(out),
        "--cpu-devices",
        "1",
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    ]
    rows = [(name, *run(command)[:2]) for name, command in phases.items()]
    print(
        f"\n2-layer Llama (hidden 256, 4 heads), training.seq_len={args.seq_len:,}, "
        f"{args.data} data, rope {args.rope}, one CPU device; work folder {work}"
    )
    print("| phase | seconds | peak resident GB |")
    print("|---|---|---|")
    for name, seconds, gb in rows:
        print(f"| {name} | {seconds:,.1f} | {gb:.2f} |")
    over = [name for name, _, gb in rows if gb > args.limit_gb]
    if over:
        raise SystemExit(f"over {args.limit_gb} GB: {', '.join(over)}")


if __name__ == "__main__":
    main()
