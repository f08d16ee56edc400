"""Tokenization at several corpus sizes: ``theseus tokenize`` against the ``tokenizers`` library's
own batch encoding of the same text, peak memory of each, and the start-up of training on the
result.

    PYTHONPATH=. python bench/data_bench.py [--sizes-mb 160,400,1000] [--vocab-size 2048]
        [--work DIR] [--tokenize-only] [--busy]

The corpora are JSON Lines files (8 per corpus) of documents of 200 to 8,000 bytes cut from the
Python standard library's source (no download), one per size of ``--sizes-mb``. A tokenizer
of ``--vocab-size`` tokens is trained once by ``theseus tokenize`` on the first corpus (unless
``--work`` holds ``tokenizer/tokenizer.json`` already), then reused, as a user reuses an existing
tokenizer. Per size, each in its own process (peak memory is
that process's maximum resident set, from ``wait4``):

- ``theseus tokenize CORPUS OUT --tokenizer tokenizer.json``, the command a user runs: wall time;
- the library alone: the same documents, read with ``json.loads`` into a list per file, encoded
  with ``Tokenizer.encode_batch`` in batches of the same 4 MiB of text; only the encoding is
  timed (reading is free for it), so the ratio is a lower bound for theseus;
- training start-up: ``load_corpus(OUT)``, its fingerprint, a stateless sampler and the first
  global batch of 32 × 256 tokens, as ``theseus train`` does before compiling (timed after the
  imports; with the growth of the peak resident set it causes).

``--startup-only`` measures only the start-up, on the token folders of an earlier run in
``--work``; ``--tokenize-only`` measures only ``theseus tokenize`` (its wall time, CPU time and
peak memory). ``--busy`` loads the machine while measuring: one busy-loop process per core runs
from before the first measurement to after the last, so every process measured shares the cores
(the encoder and the writer lag behind the reader as they would on a loaded machine).

Prints a table; asserts nothing. Throughput is MB of text per second of each process's wall time;
the table shows medians over ``--repeats`` back-to-back pairs, and a line per size gives the ratio
of the fastest runs (least disturbed by other jobs on a shared machine) and the median of the
paired ratios. The last line compares tokenize's peak memory over the sizes (largest over
smallest peak).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from theseus.data.tokens import builtin_files  # noqa: E402

NUM_FILES = 8
SHARD_TOKENS = 2**24  # several shards per split at 240 MB

LIBRARY = r"""
import json, sys, time
from pathlib import Path
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
seconds = tokens = 0
for path in sorted(Path(sys.argv[2]).glob("*.jsonl")):
    texts = [json.loads(line)["text"] for line in path.open("rb")]
    batch, size = [], 0
    for text in texts + [None]:
        if text is not None:
            batch.append(text)
            size += len(text)
        if batch and (text is None or size >= 4 * 2**20):
            start = time.perf_counter()
            tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False))
            seconds += time.perf_counter() - start
            batch, size = [], 0
print(json.dumps({"encode_seconds": seconds, "tokens": tokens}))
"""

STARTUP = r"""
import json, resource, sys, time
from theseus.data import Sampler, load_corpus
start = time.perf_counter()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
corpus = load_corpus(sys.argv[1])
corpus.fingerprint()
batch = Sampler(corpus.train, 256, 0).global_batch(0, 1, 32)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"seconds": time.perf_counter() - start, "grown_mb": grown / 1024}))
"""


def make_corpus(folder: Path, size_mb: int, seed: int = 0) -> int:
    """JSON Lines files of documents cut from the stdlib source, ``size_mb`` MB in all."""
    folder.mkdir(parents=True, exist_ok=True)
    root, names = builtin_files()
    text = "".join((root / name).read_text(errors="replace") for name in names)
    rng = random.Random(seed)
    target = size_mb * 10**6
    written = 0
    files = [open(folder / f"part-{i:02d}.jsonl", "w") for i in range(NUM_FILES)]  # noqa: SIM115
    try:
        while written < target:
            length = rng.randint(200, 8000)
            start = rng.randrange(0, len(text) - length)
            line = json.dumps({"id": written, "text": text[start : start + length]}) + "\n"
            files[rng.randrange(NUM_FILES)].write(line)
            written += len(line)
    finally:
        for f in files:
            f.close()
    return written


def run_measured(command: list[str], env: dict | None = None) -> tuple[float, float, str, float]:
    """(wall seconds, peak resident MB, stdout, CPU seconds) of a child process."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed with status {status}")
    return seconds, usage.ru_maxrss / 1024, out, usage.ru_utime + usage.ru_stime


def busy_processes(count: int) -> list[subprocess.Popen]:
    """``count`` processes that each keep one core busy until killed."""
    loop = "while True:\n    pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="160,400,1000")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, back to back")
    parser.add_argument("--startup-only", action="store_true")
    parser.add_argument("--tokenize-only", action="store_true", help="no library, no start-up")
    parser.add_argument("--busy", action="store_true", help="one busy-loop process per core")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="theseus-data-bench-"))
    theseus = [sys.executable, "-m", "theseus"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    corpora = {}
    for size in sizes:
        corpora[size] = work / f"corpus-{size}mb"
        if not corpora[size].is_dir():
            make_corpus(corpora[size], size)
    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        subprocess.run(
            [
                *theseus,
                "tokenize",
                corpora[sizes[0]],
                tokenizer_dir,
                "--vocab-size",
                str(args.vocab_size),
                "--train-sample-bytes",
                str(32 * 2**20),
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
    tokenizer = tokenizer_dir / "tokenizer.json"
    busy = busy_processes(os.cpu_count() or 1) if args.busy else []
    try:
        rows, ratios = measure(args, sizes, corpora, work, tokenizer, env)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    loaded = f", {len(busy)} busy-loop processes beside" if busy else ""
    print(
        f"machine: {os.cpu_count()} cores{loaded}, load {os.getloadavg()[0]:.1f}; "
        f"work folder {work}"
    )
    if args.tokenize_only:
        print("| corpus | text MB | theseus tokenize: wall s (MB/s), CPU s | peak MB |")
        print("|---|---|---|---|")
        for size, mb, ours_s, ours_cpu, ours_mb, *_ in rows:
            print(
                f"| {size} MB JSONL | {mb:.0f} | {ours_s:.1f} ({mb / ours_s:.2f}), "
                f"{ours_cpu:.1f} | {ours_mb:.0f} |"
            )
    else:
        print(
            "| corpus | text MB | theseus tokenize: wall s (MB/s), CPU s, peak MB | library "
            "encode_batch: encode s (MB/s), process CPU s, peak MB | ratio of throughput (wall) "
            "| ratio (CPU) | train start-up s, memory growth MB |"
        )
        print("|---|---|---|---|---|---|---|")
        for size, mb, ours_s, ours_cpu, ours_mb, enc_s, lib_cpu, lib_mb, start_s, start_mb in rows:
            print(
                f"| {size} MB JSONL | {mb:.0f} | {ours_s:.1f} ({mb / ours_s:.2f}), "
                f"{ours_cpu:.1f}, {ours_mb:.0f} | {enc_s:.1f} ({mb / enc_s:.2f}), "
                f"{lib_cpu:.1f}, {lib_mb:.0f} | {enc_s / ours_s:.2f}× | "
                f"{lib_cpu / ours_cpu:.2f}× | {start_s:.2f}, {start_mb:.0f} |"
            )
    for size, best, paired in ratios:
        print(
            f"{size} MB: throughput ratio of the fastest runs {best:.2f}×, median of the "
            f"{args.repeats} back-to-back pairs {paired:.2f}×"
        )
    if len(rows) > 1:
        peaks = [row[4] for row in rows]
        print(
            f"peak memory of tokenize, largest / smallest over the sizes: "
            f"{max(peaks) / min(peaks):.3f}"
        )


def measure(args, sizes, corpora, work, tokenizer, env) -> tuple[list, list]:
    """Per size: the table's row (tokenize's, and unless ``--tokenize-only`` the library's and
    the start-up's figures) and the library's throughput ratios."""
    theseus = [sys.executable, "-m", "theseus"]
    rows = []
    ratios = []  # (size, best library time / best theseus time, median of paired ratios)
    for size in sizes:
        text_mb = (
            sum(
                len(json.loads(line)["text"].encode())
                for path in corpora[size].glob("*.jsonl")
                for line in path.open("rb")
            )
            / 10**6
        )
        out = work / f"tokens-{size}mb"
        if not args.tokenize_only:
            _, _, report, _ = run_measured([sys.executable, "-c", STARTUP, str(out)], env)
            startup = json.loads(report)
            print(
                f"{size} MB: training start-up {startup['seconds']:.3f} s, "
                f"+{startup['grown_mb']:.1f} MB"
            )
        if args.startup_only:
            continue
        command = [*theseus, "tokenize", corpora[size], out, "--tokenizer", tokenizer]
        command += ["--shard-tokens", str(SHARD_TOKENS)]
        ours, library = [], []
        for _ in range(args.repeats):  # back to back, so both see the same load
            ours.append(run_measured([str(c) for c in [*command, "--overwrite"]], env))
            if not args.tokenize_only:
                library.append(
                    run_measured(
                        [sys.executable, "-c", LIBRARY, str(tokenizer), str(corpora[size])]
                    )
                )
        ours_s = statistics.median(r[0] for r in ours)
        ours_cpu = statistics.median(r[3] for r in ours)
        ours_mb = max(r[1] for r in ours)
        print(f"{size} MB: tokenize {ours_s:.1f} s, peak {ours_mb:.0f} MB", flush=True)
        if args.tokenize_only:
            rows.append((size, text_mb, ours_s, ours_cpu, ours_mb))
            continue
        best = min(json.loads(r[2])["encode_seconds"] for r in library) / min(r[0] for r in ours)
        pairs = [
            json.loads(lib[2])["encode_seconds"] / mine[0]
            for mine, lib in zip(ours, library, strict=True)
        ]
        ratios.append((size, best, statistics.median(pairs)))
        encode_s = statistics.median(json.loads(r[2])["encode_seconds"] for r in library)
        library_cpu = statistics.median(r[3] for r in library)
        library_mb = max(r[1] for r in library)
        _, _, report, _ = run_measured([sys.executable, "-c", STARTUP, str(out)], env)
        startup_s, startup_mb = json.loads(report)["seconds"], json.loads(report)["grown_mb"]
        row = (size, text_mb, ours_s, ours_cpu, ours_mb, encode_s, library_cpu, library_mb)
        rows.append((*row, startup_s, startup_mb))
    return rows, ratios


if __name__ == "__main__":
    main()
