"""Tokenizing a chat corpus: ``theseus tokenize`` (render, encode, mask, write) against the
``tokenizers`` library's own batch encoding of the already rendered text, with peak memory.

    PYTHONPATH=. python bench/chat_bench.py [--size-mb 20] [--template chatml|generation] [--work DIR]

The corpus is one JSON Lines file of conversations (a system prompt in half of them, 1 to 4
user/assistant turns of 20 to 1,500 characters cut from the Python standard library's source; no
download). The tokenizer is a byte-level BPE of 8,192 tokens trained here on 4 MB of it, in a
tokenizer folder with a ChatML template: ``chatml`` (Qwen2.5's, a default system prompt; masks by
prefix rendering) or ``generation`` (the same with ``{% generation %}`` blocks). Each side runs in
its own process, timed, its resident memory (with any worker processes) sampled from /proc:

- ``theseus tokenize CORPUS OUT --tokenizer FOLDER``, the command a user runs, whole;
- the library: the conversations rendered beforehand (untimed) into a JSON file, read, then
  encoded with ``Tokenizer.encode_batch_fast`` (no offsets) and ``encode_batch`` (with each
  token's offsets) in batches of 4 MiB of text; only the encoding is timed, so the ratios are
  lower bounds for theseus. theseus itself encodes byte-level tokenizers' conversations with
  ``encode_batch_fast`` and masks them from the bytes each id spells
  (:class:`theseus.tokenization.chat.encoder.ByteSpelling`), in one worker process per core.

Then the train split's examples are packed into rows of ``--seq-len`` + 1 tokens (longer ones
truncated) as a training run packs them (:func:`theseus.data.packing.pack`, first-fit decreasing
over buffers of 1,024 shuffled examples): the non-padding fraction and the seconds it took.

Prints one table; asserts nothing. Throughput is MB of rendered text per second.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from theseus.data.packing import pack  # noqa: E402
from theseus.data.shards import example_lengths, read_manifest  # noqa: E402
from theseus.data.tokens import builtin_files  # noqa: E402
from theseus.tokenization.chat.records import parse_record  # noqa: E402
from theseus.tokenization.chat.template import ChatTemplate  # noqa: E402

CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by "
    "Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GENERATION = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by "
    "Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

LIBRARY = r"""
import json, sys, time
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
texts = json.loads(open(sys.argv[2]).read())
result = {}
for name in ("encode_batch_fast", "encode_batch"):
    encode = getattr(tokenizer, name)
    seconds = tokens = 0
    batch, size = [], 0
    for text in texts + [None]:
        if text is not None:
            batch.append(text)
            size += len(text)
        if batch and (text is None or size >= 4 * 2**20):
            start = time.perf_counter()
            tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
            seconds += time.perf_counter() - start
            batch, size = [], 0
    result[name] = {"seconds": seconds, "tokens": tokens}
print(json.dumps(result))
"""


def make_corpus(path: Path, size_mb: int, seed: int = 0) -> None:
    root, names = builtin_files()
    text = "".join((root / name).read_text(errors="replace") for name in names)
    rng = random.Random(seed)

    def cut() -> str:
        length = rng.randint(20, 1500)
        start = rng.randrange(0, len(text) - length)
        return text[start : start + length]

    written = 0
    with path.open("w") as stream:
        while written < size_mb * 10**6:
            messages = [{"role": "system", "content": cut()}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(1, 4)):
                messages += [
                    {"role": "user", "content": cut()},
                    {"role": "assistant", "content": cut()},
                ]
            line = json.dumps({"messages": messages}) + "\n"
            stream.write(line)
            written += len(line)


def make_tokenizer(folder: Path, corpus: Path, template: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    sample = corpus.read_text()[: 4 * 10**6].splitlines()
    tokenizer.train_from_iterator(sample, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def timed(command: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak resident MB of the process and all its children together, stdout)
    of a command; memory is sampled every 20 ms from /proc (worker processes count too)."""
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss_kb(process.pid))
        time.sleep(0.02)
    wall = time.perf_counter() - began
    stdout = process.stdout.read()
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return wall, peak / 1024, stdout


def tree_rss_kb(pid: int) -> int:
    """Resident kB of ``pid`` and its descendants (0 for those that are gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0
    rss = re.search(r"VmRSS:\s+(\d+)", status)
    return (int(rss.group(1)) if rss else 0) + sum(tree_rss_kb(int(c)) for c in children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=20)
    parser.add_argument("--template", choices=("chatml", "generation"), default="chatml")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="theseus-chat-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"chats-{args.size_mb}mb.jsonl"
    if not corpus.is_file():
        make_corpus(corpus, args.size_mb)
    source = CHATML if args.template == "chatml" else GENERATION
    folder = work / f"tokenizer-{args.template}"
    make_tokenizer(folder, corpus, source)
    template = ChatTemplate(source, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    rendered = work / f"rendered-{args.template}.json"
    with corpus.open() as stream:
        texts = [
            template.render(
                parse_record(json.loads(line), 0, "").messages, add_generation_prompt=False
            )
            for line in stream
        ]
    rendered.write_text(json.dumps(texts))
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    del texts
    out = work / f"out-{args.template}"
    theseus = [sys.executable, "-m", "theseus", "tokenize", str(corpus), str(out)]
    wall, peak, _ = timed([*theseus, "--tokenizer", str(folder), "--overwrite"])
    _, library_peak, printed = timed(
        [sys.executable, "-c", LIBRARY, str(folder / "tokenizer.json"), str(rendered)]
    )
    library = json.loads(printed)
    manifest = json.loads((out / "tokens.json").read_text())
    tokens = sum(manifest["splits"][s]["tokens"] for s in ("train", "validation"))
    trained = sum(manifest["splits"][s]["trained_tokens"] for s in ("train", "validation"))
    print(
        f"{megabytes:.1f} MB of rendered chat text, template {args.template}, {tokens:,} tokens "
        f"({trained / tokens:.1%} trained)"
    )
    print(f"{'':34} {'seconds':>8} {'MB/s':>7} {'peak MB':>8} {'ratio':>6}")
    print(
        f"{'theseus tokenize (whole command)':34} {wall:8.1f} {megabytes / wall:7.2f} {peak:8.0f}"
    )
    for name, figures in library.items():
        rate = megabytes / figures["seconds"]
        print(
            f"{'tokenizers ' + name + ' (encode only)':34} {figures['seconds']:8.1f} "
            f"{rate:7.2f} {library_peak:8.0f} {megabytes / wall / rate:6.2f}"
        )

    lengths = example_lengths(out, read_manifest(out), "train")  # (examples,)
    began = time.perf_counter()
    packing = pack(lengths, args.seq_len + 1, 0, "truncate", "bench")
    seconds = time.perf_counter() - began
    print(
        f"packing {lengths.size:,} examples (median {np.median(lengths):.0f}, max {lengths.max()} "
        f"tokens) into {packing.num_rows:,} rows of seq_len + 1 = {args.seq_len + 1}: "
        f"{packing.efficiency:.1%} non-padding, {packing.truncated} truncated, {seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
