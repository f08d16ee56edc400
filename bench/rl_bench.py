"""Where an RL step's time goes, and whether rollouts generate as fast as `theseus generate`.

An RL run (`llama/train/rl`) of a stated model on byte prompts of one length, in this process:
each step's rollout generation, its scoring by the reward function, and the training step
(`rollout/generate_s`, `rollout/score_s`, `step_time_s` of metrics.jsonl; the first step,
which compiles, left out). Then `theseus.generate` of the run's checkpoint on the same batch
(the same prompts, completions per prompt, new tokens and sampling), twice (the second is
timed), and the ratio of the two generation rates (new tokens per second, prefill included,
compilation excluded). The issue's bar: rollouts at 0.9× `generate`'s rate or better.

    python bench/rl_bench.py [--steps 12] [--hidden 256] [--layers 4] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")

REWARD = '''
def vowels(completions, **kwargs):
    """The share of vowels in the completion (any number will do: the bench times it)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    args = parser.parse_args()

    import theseus
    from theseus.plot import read_metrics

    work = Path(tempfile.mkdtemp(prefix="rl_bench_"))
    words = ["The quick brown fox ", "Beautiful is better ", "Explicit is better ", "Now is "]
    prompts = [(words[i % 4] * 4)[:32] for i in range(64)]  # 32 bytes each
    with (work / "prompts.jsonl").open("w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    (work / "rewards.py").write_text(REWARD)
    batch = args.prompts * args.generations
    heads = max(1, args.hidden // 64)
    settings = [
        f"data.path={work / 'prompts.jsonl'}", f"rl.rewards=[{work / 'rewards.py'}:vowels]",
        f"rl.num_generations={args.generations}", f"rl.max_completion_length={args.new_tokens}",
        "model.vocab_size=256", f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={4 * args.hidden}", f"model.num_layers={args.layers}",
        f"model.num_heads={heads}", f"model.num_kv_heads={heads}",
        f"model.max_position_embeddings={32 + args.new_tokens}",
        f"training.seq_len={32 + args.new_tokens}", f"training.batch_size={batch}",
        f"training.per_device_batch_size={batch}", f"training.steps={args.steps}",
        f"training.validation_interval={args.steps}", "data.validation_fraction=0.1",
        "logging.progress_bar=false",
    ]  # fmt: skip
    run = work / "run"
    theseus.chain("llama/train/rl", *settings).run(run)
    rows = read_metrics(run / "00-llama-train-rl")[1:]  # the first step compiles
    generate_s = statistics.median(r["rollout/generate_s"] for r in rows)
    score_s = statistics.median(r["rollout/score_s"] for r in rows)
    # A row's step time runs from the step before's end to its own: its rollout included.
    train_s = statistics.median(
        r["step_time_s"] - r["rollout/generate_s"] - r["rollout/score_s"] for r in rows
    )
    rollout_rate = statistics.median(r["rollout/tokens_per_s"] for r in rows)
    total = generate_s + score_s + train_s
    print(
        f"model: Llama, hidden {args.hidden}, {args.layers} layers; {args.prompts} prompts × "
        f"{args.generations} completions of {args.new_tokens} tokens; {jax.device_count()} "
        f"device(s), {jax.devices()[0].platform}"
    )
    for name, seconds in (("generate", generate_s), ("score", score_s), ("train", train_s)):
        print(f"  {name:9s} {seconds * 1000:8.1f} ms  {100 * seconds / total:5.1f}%")
    chosen = prompts[: args.prompts]
    options = {"max_new_tokens": args.new_tokens, "num_samples": args.generations}
    theseus.generate(run / "00-llama-train-rl", chosen, **options)  # compiles
    rates = [
        theseus.generate(run / "00-llama-train-rl", chosen, seed=seed, **options).tokens_per_s
        for seed in range(5)
    ]
    generate_rate = statistics.median(rates)
    print(
        f"rollout {rollout_rate:,.0f} tokens/s (median of {len(rows)} steps); theseus generate "
        f"{generate_rate:,.0f} tokens/s (median of {len(rates)}) on the same batch: ratio "
        f"{rollout_rate / generate_rate:.2f}"
    )


if __name__ == "__main__":
    main()
