"""Does LoRA DPO learn? Pairs from the built-in corpus (the Python standard library's source, byte
tokens): a prompt of 16 bytes, the chosen completion the next 24 bytes of the passage, the
rejected one the same bytes shuffled. A small random Llama with LoRA adapters trains on packed
pairs of the train split; the validation pairs' reward accuracy and margin are printed as it goes.

    python bench/preference_learns.py [--steps 150] [--lora-rank 8]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from theseus.config import apply_overrides
from theseus.data import load_corpus
from theseus.data.pairs import PairSampler, examples_of_pairs
from theseus.jobs import get_job
from theseus.model.families.llama import LlamaConfig
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.reference import split_reference

MODEL = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
SEQ_LEN, ROWS = 127, 16


def passage_pairs(tokens: np.ndarray, count: int, seed: int):
    """``count`` pairs: 16 bytes of a passage, then its next 24 (chosen) or those shuffled."""
    rng = np.random.default_rng(seed)
    made = []
    for start in rng.integers(0, tokens.size - 40, count):
        prompt, real = (
            np.asarray(tokens[start : start + 16]),
            np.asarray(tokens[start + 16 : start + 40]),
        )
        mask = np.r_[np.zeros(16), np.ones(24)]
        made.append((np.r_[prompt, real], mask, np.r_[prompt, rng.permutation(real)], mask))
    return examples_of_pairs(made)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    corpus = load_corpus(None)
    cls = get_job("llama/train/preference").trainer_class
    settings = [
        f"training.batch_size={ROWS}", f"training.per_device_batch_size={ROWS}",
        f"training.seq_len={SEQ_LEN}", f"training.steps={args.steps}",
        f"finetune.lora_rank={args.lora_rank}", "optimization.learning_rate=3e-3",
        "optimization.warmup_steps=10",
    ]  # fmt: skip
    config = apply_overrides(cls.config_class(model=MODEL), settings)
    policy = ShardingPolicy()
    trainer = cls(config, policy, Topology.new(policy, devices=jax.devices()[:1]))
    state = trainer.init_state()
    train = PairSampler(passage_pairs(corpus.train, 4096, 0), SEQ_LEN, 0, "error", "packed", "t")
    held = PairSampler(passage_pairs(corpus.validation, 256, 1), SEQ_LEN, 0, "error", "packed", "v")
    train.reference = split_reference(trainer, train, state.params)
    held.reference = split_reference(trainer, held, state.params)
    rows = held.global_batch(0, 1, held.num_windows - held.num_windows % ROWS)
    rows = rows.reshape(-1, ROWS, *rows.shape[2:])
    validation = trainer.put_batch(lambda r: rows[:, r], rows.shape)

    def report(step: int) -> None:
        got = jax.device_get(trainer.validation_step(state.params, validation))
        print(
            f"step {step}: val_loss {got['loss']:.4f} val_rewards/accuracies "
            f"{got['rewards/accuracies']:.3f} val_rewards/margins {got['rewards/margins']:.4f}",
            flush=True,
        )

    report(0)
    for step in range(1, args.steps + 1):
        batch = train.global_batch((step - 1) * ROWS, 1, ROWS)
        state, _ = trainer.train_step(
            state, trainer.put_batch(lambda r, b=batch: b[:, r], batch.shape)
        )
        if step % 25 == 0 or step == args.steps:
            report(step)


if __name__ == "__main__":
    main()
