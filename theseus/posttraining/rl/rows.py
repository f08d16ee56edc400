"""A generation batch as the rows an RL step reads, and back.

A completion row is int32 ``(RL_FIELDS, seq_len + 1)``: the segmented row of
:mod:`theseus.data.packing` (tokens: the prompt then the completion; mask: 1 on the completion
tokens that train; segment 1 on both, 0 on the padding after them), then float32 fields stored as
their bits, each at the position of the token it belongs to: the completion's advantage (at
position 0), each completion token's loss weight, metric weight and clip-metric weight (what TRL's
aggregation makes of it, :func:`~theseus.posttraining.rl.objective.aggregation_weights` and
:func:`~theseus.posttraining.rl.objective.metric_weights`, times the completions of a step; the clip
ratios of sequence-level importance sampling are means over sequences), its log-probability when the rollout was drawn under the model (the old one, where a
batch trains several steps) and under the sampler.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from theseus.data.packing import MASK, SEGMENTS, TOKENS

ADVANTAGE, LOSS_WEIGHT, METRIC_WEIGHT, CLIP_WEIGHT, OLD_LOGPS, SAMPLER_LOGPS = range(3, 9)
RL_FIELDS = 9


@dataclass(frozen=True)
class Completions:
    """The completions of a generation batch (rows prompt-major: prompt ``p``'s sample ``s``
    is row ``p * num_generations + s``), each cut after its first end id."""

    prompt_ids: list[list[int]]  # per row, the prompt's ids
    ids: list[list[int]]  # per row, the completion's ids (its end id included)
    sampler_logps: list[list[float]]  # per row, each completion id's log-probability drawn
    terminated: np.ndarray  # (rows,) bool: the completion ends with an end id

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(c) for c in self.ids], np.int64)  # (rows,)

    def trained(self, *, mask_truncated: bool, width: int) -> np.ndarray:
        """(rows, width) float: 1 on the completion tokens that train (none of a truncated
        completion with ``mask_truncated``)."""
        mask = np.arange(width)[None, :] < self.lengths[:, None]  # (rows, width)
        if mask_truncated:
            mask &= self.terminated[:, None]
        return mask.astype(np.float64)


def cut_at_end(
    prompt_ids: Sequence[Sequence[int]],
    new_ids: np.ndarray,
    new_logps: np.ndarray,
    end_ids: Collection[int],
) -> Completions:
    """The generator's new ids and log-probabilities (rows, n) cut after each row's first end
    id (as transformers' ``generate`` stops a row), for prompts ``prompt_ids`` (one per row)."""
    ends = np.isin(new_ids, np.asarray(sorted(end_ids), np.int64))  # (rows, n)
    terminated = np.asarray(ends.any(axis=1), bool)  # (rows,)
    lengths = np.where(terminated, ends.argmax(axis=1) + 1, new_ids.shape[1])
    return Completions(
        [list(p) for p in prompt_ids],
        [new_ids[r, :n].tolist() for r, n in enumerate(lengths)],
        [new_logps[r, :n].tolist() for r, n in enumerate(lengths)],
        terminated,
    )


def as_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as the int32 bits a row stores."""
    return np.asarray(values, np.float32).view(np.int32)


def completion_rows(
    completions: Completions,
    *,
    trained: np.ndarray,
    advantages: np.ndarray,
    loss_weights: np.ndarray,
    metric_weights: np.ndarray,
    clip_weights: np.ndarray,
    old_logps: np.ndarray | None,
    row_tokens: int,
) -> np.ndarray:
    """The rows (completions, RL_FIELDS, row_tokens) of ``completions``: ``trained``,
    ``loss_weights``, ``metric_weights`` and ``clip_weights`` (completions, width) per completion
    token,
    ``advantages`` (completions,), ``old_logps`` (completions, width) or None (zeros: the step
    takes the current ones)."""
    rows = np.zeros((len(completions.ids), RL_FIELDS, row_tokens), np.int32)
    floats = np.zeros((len(completions.ids), RL_FIELDS, row_tokens), np.float32)
    for r, (prompt, ids) in enumerate(zip(completions.prompt_ids, completions.ids, strict=True)):
        start, end = len(prompt), len(prompt) + len(ids)
        assert end <= row_tokens, (end, row_tokens)  # the prompt width was checked
        n = len(ids)
        rows[r, TOKENS, :end] = prompt + ids
        rows[r, SEGMENTS, :end] = 1
        rows[r, MASK, start:end] = trained[r, :n]
        floats[r, ADVANTAGE, 0] = advantages[r]
        floats[r, LOSS_WEIGHT, start:end] = loss_weights[r, :n]
        floats[r, METRIC_WEIGHT, start:end] = metric_weights[r, :n]
        floats[r, CLIP_WEIGHT, start:end] = clip_weights[r, :n]
        floats[r, SAMPLER_LOGPS, start:end] = completions.sampler_logps[r]
        if old_logps is not None:
            floats[r, OLD_LOGPS, start:end] = old_logps[r, :n]
    rows[:, ADVANTAGE:] = floats[:, ADVANTAGE:].view(np.int32)
    return rows
