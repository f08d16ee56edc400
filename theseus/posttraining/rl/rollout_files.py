"""The rollouts an RL run keeps: ``rollouts/<step>.jsonl``, one completion a line, for every
generation batch (``<step>``: the first step that trains on it). A line holds the ``prompt`` (as
given: text or messages), the ``completion`` (text), ``prompt_ids``, ``completion_ids``, each
reward function's reward (``rewards``; null: not scored), their weighted sum (``reward``), the
``advantage``, the sampler's per-token log-probabilities (``logps``) and, where the batch trains
several steps, the drawing model's (``old_logps``). Users read their completions there; a run
resumed inside a generation batch reads it back, bit for bit (float32 values survive JSON's
decimal text exactly)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from theseus.posttraining.rl.rewards import Scores
from theseus.posttraining.rl.rows import Completions

ROLLOUTS = "rollouts"


@dataclass(frozen=True)
class KeptRollouts:
    """What a rollouts file holds of a generation batch."""

    completions: Completions
    scores: Scores
    advantages: np.ndarray  # (completions,) float32
    old_logps: np.ndarray | None  # (completions, max_completion_length) float32, or None


def write_rollouts(
    folder: Path, first: int, prompts: list[Any], texts: list[str], kept: KeptRollouts
) -> None:
    """``folder/<first>.jsonl`` of a generation batch: its ``prompts`` (one per completion, as
    given) and completion ``texts``."""
    completions = kept.completions
    lines = []
    for r, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        ids = completions.ids[r]
        line = {
            "prompt": prompt,
            "completion": text,
            "prompt_ids": completions.prompt_ids[r],
            "completion_ids": ids,
            "rewards": {n: _number(v[r]) for n, v in kept.scores.per_function.items()},
            "reward": _number(kept.scores.total[r]),
            "advantage": float(kept.advantages[r]),
            "logps": [float(x) for x in np.asarray(completions.sampler_logps[r], np.float32)],
        }
        if kept.old_logps is not None:
            line["old_logps"] = [float(x) for x in kept.old_logps[r, : len(ids)]]
        lines.append(line)
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)
    (folder / f"{first}.jsonl").write_text(text)


def read_rollouts(
    folder: Path, first: int, end_ids: tuple[int, ...], names: list[str], width: int | None
) -> KeptRollouts:
    """The generation batch of ``folder/<first>.jsonl``: completions ending with one of
    ``end_ids`` terminated, the rewards of the functions ``names``, and the old
    log-probabilities padded to ``width`` (None: the file holds none to read)."""
    path = folder / f"{first}.jsonl"
    if not path.is_file():
        raise ValueError(
            f"resuming at a step inside the generation batch that step {first} drew needs "
            f"{path}, which is missing; resume from a checkpoint at the first step of a "
            "generation batch, or restore the run's rollouts folder"
        )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [line["completion_ids"] for line in lines]
    completions = Completions(
        [line["prompt_ids"] for line in lines],
        ids,
        [line["logps"] for line in lines],
        np.asarray([bool(c) and c[-1] in end_ids for c in ids], bool),
    )
    scores = Scores(
        {n: _floats([line["rewards"][n] for line in lines]) for n in names},
        _floats([line["reward"] for line in lines]),
    )
    old = None
    if width is not None:
        old = np.zeros((len(lines), width), np.float32)
        for r, line in enumerate(lines):
            old[r, : len(line["old_logps"])] = line["old_logps"]
    advantages = np.asarray([line["advantage"] for line in lines], np.float32)
    return KeptRollouts(completions, scores, advantages, old)


def _floats(values: list[float | None]) -> np.ndarray:
    """Rewards read back (None: not scored) as float32 with NaN."""
    return np.asarray([np.nan if v is None else v for v in values], np.float32)


def _number(value: float) -> float | None:
    return None if math.isnan(value) else float(value)
