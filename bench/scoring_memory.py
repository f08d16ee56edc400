"""Task scoring's memory at long contexts: the compiled (never run) scoring program of
``theseus evaluate --tasks`` by chunk of positions, beside the training step at the same length.

    python bench/scoring_memory.py [--seq 32768] [--vocab 32000] [--chunks 0,32768]

A 2-layer Llama (hidden 256, 4 heads, 2 key/value heads, MLP 688, float32) with a vocabulary of
``--vocab``, on one CPU device, its context ``--seq`` tokens. Scoring runs 4 rows per device (the
harness's default batch) at the widest width, the whole context; a chunk of 0 is the default
(:func:`theseus.model.head.default_chunk` of the vocabulary and the 4 rows), one of ``--seq``
or more the whole row at once. The training step is the run's (one example per device, its
default ``training.loss_chunk``). Prints each program's temporaries from XLA's memory analysis
and how many of its buffers have both the sequence's and the vocabulary's length; nothing is
allocated.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]


def trainer(seq: int, vocab: int, chunk: int):
    from theseus.config import apply_overrides
    from theseus.jobs import get_job
    from theseus.sharding.axis import ShardingPolicy

    trainer_class = get_job("llama/train/pretrain").trainer_class
    overrides = [
        "model.num_layers=2",
        "model.hidden_size=256",
        "model.intermediate_size=688",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        f"model.vocab_size={vocab}",
        f"model.max_position_embeddings={seq}",
        f"training.seq_len={seq}",
        "training.batch_size=1",
        "training.per_device_batch_size=1",
        *([f"training.loss_chunk={chunk}"] if chunk else []),
    ]
    config = apply_overrides(trainer_class.config_class(), overrides)
    return trainer_class(config, ShardingPolicy())


def long_buffers(hlo: str, seq: int, vocab: int) -> int:
    """Buffers of ``hlo`` with both a dimension of ``seq`` and one of ``vocab``."""
    shapes = [[int(d) for d in s.split(",") if d] for s in re.findall(r"\[([0-9,]+)\]", hlo)]
    return sum(1 for s in shapes if seq in s and vocab in s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunks", default="0,32768", help="comma-separated; 0: the default")
    args = parser.parse_args(argv)
    from theseus.inference.scoring import Scorer

    print("| program | chunk | temp bytes | GiB | (tokens, vocab) buffers |")
    print("|---|---|---|---|---|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        scorer = Scorer(trainer(args.seq, args.vocab, chunk), None)
        program = scorer.program(args.seq)
        temp = program.memory_analysis().temp_size_in_bytes
        buffers = long_buffers(program.as_text(), args.seq, args.vocab)
        print(f"| scoring, 4 rows | {scorer.chunk} | {temp:,} | {temp / 2**30:.2f} | {buffers} |")
    step = trainer(args.seq, args.vocab, 0)
    compiled = step.compile()
    temp = compiled.temporaries
    buffers = long_buffers(compiled.executable.as_text(), args.seq, args.vocab)
    print(
        f"| training step, 1 example | {step.loss_chunk} | {temp:,} | {temp / 2**30:.2f} | {buffers} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
