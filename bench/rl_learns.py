"""Does online RL learn? A GPT of 2 layers from a random start, on prompts ``a+b=``, rewarded 1
only for the digit ``(a + b) mod 10`` followed by the end token: the user's path, command by
command. A tokenizer folder of 14 tokens (the digits, ``+``, ``=``, ``<|endoftext|>``, an unknown
token), a prompt file, a reward file, then `theseus train --job gpt/train/rl` with DAPO (TRL's
default loss), 32 completions of each of 16 prompts a step, a constant learning rate of 1e-3 and a
KL to the random start (``rl.beta=0.04``: it keeps the policy from collapsing onto wrong digits,
which it does without). Prints the mean reward of every 10th step and of the held-out prompts, and
writes the curve to ``rl_learns.json`` (and ``rl_learns.png`` where matplotlib draws).

    python bench/rl_learns.py [--steps 1000] [--beta 0.04] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EOS = "<|endoftext|>"
REWARD = '''
EOS = "<|endoftext|>"


def modular_sum(prompts, completions, completion_ids, answer, **kwargs):
    """1 for the answer's digit followed by the end token (id 12), else 0."""
    return [
        1.0 if ids == [int(a), 12] else 0.0
        for ids, a in zip(completion_ids, answer)
    ]
'''


def make_tokenizer(folder: Path) -> None:
    """One token per character of ``0-9+=``, the end token (id 12) and an unknown token."""
    import tokenizers

    vocab = {c: i for i, c in enumerate("0123456789+=")} | {EOS: 12, "<unk>": 13}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex("."), behavior="isolated"
    )
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.add_special_tokens([EOS, "<unk>"])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))


def make_prompts(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--generations", type=int, default=32)
    parser.add_argument("--batch", type=int, default=512, help="completions a step")
    parser.add_argument("--width", type=int, default=64, help="model.n_embd")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.04, help="KL to the random start")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="rl_learns_"))
    make_tokenizer(work / "tokenizer")
    make_prompts(work / "prompts.jsonl", 400, seed=0)
    (work / "rewards.py").write_text(REWARD)
    run = work / "run"
    command = [
        sys.executable, "-m", "theseus", "train", "--job", "gpt/train/rl", "--out", str(run),
        "--overwrite", "data.path=prompts.jsonl", "rl.tokenizer=tokenizer",
        "rl.rewards=[rewards.py:modular_sum]", f"rl.num_generations={args.generations}", f"rl.temperature={args.temperature}", f"rl.beta={args.beta}",
        "rl.max_completion_length=3", "model.vocab_size=14", "model.n_layer=2",
        f"model.n_embd={args.width}", "model.n_head=4", "model.block_size=8", "training.seq_len=7",
        f"training.batch_size={args.batch}", f"training.per_device_batch_size={args.batch}",
        f"training.steps={args.steps}", "training.validation_interval=25",
        f"optimization.learning_rate={args.learning_rate}", "optimization.warmup_steps=5",
        "optimization.weight_decay=0.0", "optimization.min_learning_rate_ratio=1.0",
        "data.validation_fraction=0.1",
        "checkpointing.interval=1000", "logging.progress_bar=false",
    ]  # fmt: skip
    print("$", " ".join(command[2:]), flush=True)
    began = time.perf_counter()
    subprocess.run(command, check=True, cwd=work, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - began
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [(row["step"], row["reward"]) for row in rows]
    held = [(row["step"], row["val_reward"]) for row in rows if "val_reward" in row]
    for step, reward in curve[::10]:
        print(f"step {step:4d}  reward {reward:.3f}")
    print("held-out reward:", ", ".join(f"step {s}: {r:.3f}" for s, r in held))
    print(f"{len(rows)} steps in {seconds:.0f} s (compilation included)")
    (work / "rl_learns.json").write_text(json.dumps({"train": curve, "validation": held}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(*zip(*curve, strict=True), label=f"train (each step's {args.batch} completions)")
    axes.plot(*zip(*held, strict=True), "o-", label="held-out prompts")
    axes.set(xlabel="step", ylabel="mean reward", ylim=(-0.02, 1.02))
    axes.legend()
    figure.tight_layout()
    figure.savefig(work / "rl_learns.png", dpi=100)
    print("curve:", work / "rl_learns.png")


if __name__ == "__main__":
    main()
