"""RL's data as the training loop reads it (:class:`~theseus.training.run.data.RunData`): each
step's completion rows, drawn on the training mesh from the state the step starts from, scored by
the reward functions, and kept in the run (``rollouts/<step>.jsonl``).

A generation batch holds ``training.batch_size × rl.steps_per_generation`` completions,
``rl.num_generations`` per prompt, and trains ``rl.steps_per_generation × rl.num_iterations``
steps. Its prompts are the next ones of the train prompts in an order shuffled per epoch (seeded
by ``training.seed``); its sampling keys depend on the seed, the generation, the row and the
position alone (:mod:`theseus.inference.sampling`), so every layout, device count and process
count draws the same completions. A run resumed inside a generation reads that generation back
from its rollouts file, which holds everything its rows are made of.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from theseus.distributed.join import is_main_process
from theseus.inference.codec import ByteCodec, TokenizerCodec, resolve_codec
from theseus.inference.generator import Generator
from theseus.inference.sampling import Sampling
from theseus.posttraining.rl.objective import aggregation_weights, group_advantages, metric_weights
from theseus.posttraining.rl.prompts import (
    PromptRecord,
    completion_for,
    decode_completion,
    encode_prompts,
    held_out,
    read_prompts,
    reward_columns,
)
from theseus.posttraining.rl.rewards import RewardFunction, Scores, load_reward, score
from theseus.posttraining.rl.rollout_files import (
    ROLLOUTS,
    KeptRollouts,
    read_rollouts,
    write_rollouts,
)
from theseus.posttraining.rl.rows import Completions, completion_rows, cut_at_end
from theseus.posttraining.rl.scoring import generation_logps, logps_step
from theseus.posttraining.rl.trainer import RLTrainer
from theseus.tokenization.folder import TOKENIZER_FILE
from theseus.training.run.data import StepBatch, Validated
from theseus.training.run.identity import copy_tokenizer_files
from theseus.training.state import TrainState
from theseus.training.trainer import BaseTrainer

_ORDER, _SAMPLING, _VALIDATION = 0x5EED, 0x5A3B, 0x7A11  # keep the seeded streams apart


@dataclass(frozen=True)
class Generation:
    """A generation batch: the rows the steps read, what the host measured making them, and
    its prompt and completion tokens."""

    rows: np.ndarray  # (completions, RL_FIELDS, seq_len + 1)
    metrics: dict[str, float]
    tokens: int  # prompt and completion tokens (TRL's num_tokens counts them)


@dataclass(frozen=True)
class Sampled:
    """A generation's completions and its rate (new tokens per second, prefill included)."""

    completions: Completions
    tokens_per_s: float


class RolloutData:
    """The prompts of ``data.path`` and the rollouts drawn from them (see the module
    docstring)."""

    def __init__(self, trainer: RLTrainer, out_dir: Path, *, base_dir: Path | None = None):
        self.trainer, self.out_dir = trainer, Path(out_dir)
        config, rl = trainer.config, trainer.rl
        check_rollouts(trainer)
        if not config.data.path:
            raise ValueError(
                "an RL run reads prompts from data.path (JSON Lines or Parquet records with a "
                "'prompt'); set data.path=prompts.jsonl"
            )
        if not rl.rewards:
            raise ValueError(
                "rl.rewards names no reward function; give at least one, e.g. "
                "'rl.rewards=[theseus.posttraining.rl.rewards:accuracy]' or "
                "'rl.rewards=[my_rewards.py:correct]'"
            )
        self.functions: list[RewardFunction] = [load_reward(spec) for spec in rl.rewards]
        self.records = read_prompts(config.data.path)
        # The run's own copy first (a resumed or evaluated run, wherever it moved), then
        # rl.tokenizer, then the --init-from run's.
        own = (self.out_dir / TOKENIZER_FILE).is_file()
        dirs = [self.out_dir, *([base_dir] if base_dir is not None else [])]
        vocab = trainer.decoder().vocab_size
        codec = resolve_codec(dirs, None if own else rl.tokenizer, None, vocab)
        assert isinstance(codec, (TokenizerCodec, ByteCodec)), codec  # resolve_codec's two
        self.codec: TokenizerCodec | ByteCodec = codec
        self.prompt_ids = encode_prompts(self.records, codec)
        self._check_lengths()
        self.split = held_out(
            len(self.records), config.data.validation_fraction, config.training.seed
        )
        self.end_ids = tuple(self.codec.eos_ids)
        self.sampling = Sampling(rl.temperature, rl.top_k, rl.top_p)
        self.generator = Generator(trainer, None)
        self._logps = logps_step(trainer) if rl.reuses_rollouts else None
        self._buffer: tuple[int, Generation] | None = None
        self._tokens_seen: int | None = None

    # --- RunData ---------------------------------------------------------------------------

    @property
    def description(self) -> str:
        return (
            f"prompts {self.trainer.config.data.path} ({self.split.train.size} train, "
            f"{self.split.validation.size} held out; {self.codec.description})"
        )

    @property
    def tokenizer(self) -> Path | None:
        return None  # prepared() keeps the tokenizer folder's files in the run

    def facts(self) -> dict[str, Any]:
        rl = self.trainer.rl
        return {
            "rl": {
                "prompts": len(self.records),
                "held_out": int(self.split.validation.size),
                "prompt_width": self.trainer.prompt_width,
                "end_ids": list(self.end_ids),
                "rewards": [f.name for f in self.functions],
                "completions_per_generation": self.num_completions,
                "steps_per_generation_batch": rl.steps_per_rollout,
            }
        }

    def batch_shape(self) -> tuple[int, ...]:
        return self.trainer.batch_shape

    def prepared(self, params: Any, run_dir: Path) -> RolloutData:
        """The prompts' tokenizer files kept in the run (its end ids and chat template too),
        which generation, evaluation and a resume read wherever the run moves; the rollouts
        are drawn from each step's own state."""
        del params
        folder = self.codec.folder if isinstance(self.codec, TokenizerCodec) else None
        if folder is not None and folder.path.resolve() != run_dir.resolve() and is_main_process():
            copy_tokenizer_files(folder.path, run_dir)
        return self

    def batch(self, step: int, position: int, state: TrainState) -> StepBatch:
        """Step ``step``'s rows: its slice of its generation batch, drawn from ``state`` at the
        generation's first step (read back from its rollouts file on a resume)."""
        del position  # the step says which generation and slice
        rl = self.trainer.rl
        index, within = divmod(step - 1, rl.steps_per_rollout)
        first = index * rl.steps_per_rollout + 1
        if self._buffer is None or self._buffer[0] != index:
            seen = self._tokens_before(first) if self._tokens_seen is None else self._tokens_seen
            drawn = self._drawn(first, index, state) if within == 0 else self._read(first)
            self._tokens_seen = seen + drawn.tokens
            self._buffer = (index, drawn)
        generation = self._buffer[1]
        size = self.trainer.batch_plan.global_batch_size
        slot = within % rl.steps_per_generation
        rows = generation.rows[slot * size : (slot + 1) * size]
        shape = self.batch_shape()
        placed = self.trainer.put_batch(lambda part: rows.reshape(shape)[:, part], shape)
        assert self._tokens_seen is not None  # counted when the buffer was filled
        return StepBatch(placed, {**generation.metrics, "num_tokens": float(self._tokens_seen)})

    def validate(self, params: Any, reference: Any = None) -> Validated:
        """The held-out prompts' rewards and completion lengths (``val_reward``...), from
        completions drawn with a fixed seed: as many prompts as a generation batch has (the
        held-out ones over again when there are fewer); none without held-out prompts."""
        del reference  # rewards score completions, not a reference
        held = self.split.validation
        if held.size == 0:
            return Validated(None, None, {})
        chosen = held[np.arange(self.num_prompts) % held.size]
        seed = _seed(self.trainer.config.training.seed, 0, _VALIDATION)
        completions = self._generate(params, chosen, seed).completions
        records = self._rows_of(chosen)
        texts = [decode_completion(ids, self.codec) for ids in completions.ids]
        scores = self._scores(completions, records, texts, step=0)
        return Validated(None, None, {**scores.metrics(), **_length_metrics(completions)})

    # --- generations -----------------------------------------------------------------------

    @property
    def num_completions(self) -> int:
        return self.trainer.num_completions

    @property
    def num_prompts(self) -> int:
        return self.num_completions // self.trainer.rl.num_generations

    def _drawn(self, first: int, index: int, state: TrainState) -> Generation:
        """Generation ``index`` (first step ``first``) drawn from ``state`` and scored."""
        rl, trainer = self.trainer.rl, self.trainer
        chosen = self._prompts_of(index)
        seed = _seed(trainer.config.training.seed, index, _SAMPLING)
        # The state is the step before's, still computing: the rollout's clock starts when it is.
        params = jax.block_until_ready(state.params)
        began = time.perf_counter()
        sampled = self._generate(params, chosen, seed)
        generated = time.perf_counter()
        completions, records = sampled.completions, self._rows_of(chosen)
        texts = [decode_completion(ids, self.codec) for ids in completions.ids]
        scores = self._scores(completions, records, texts, step=first)
        scored = time.perf_counter()
        advantages = group_advantages(scores.total, rl.num_generations, rl.scale_rewards).advantages
        rows = self._rows(completions, advantages, None)
        old = None
        if self._logps is not None:  # the drawing model's log-probabilities, kept as old
            per_target = generation_logps(trainer, self._logps, state.params, rows)
            old = _per_completion(per_target, completions, rl.max_completion_length)
            rows = self._rows(completions, advantages, old)
        if is_main_process():
            kept = KeptRollouts(completions, scores, advantages, old)
            write_rollouts(self.out_dir / ROLLOUTS, first, [r.prompt for r in records], texts, kept)
        timing = {  # where a rollout's time goes (the step's own time is step_time_s)
            "rollout/generate_s": generated - began,
            "rollout/score_s": scored - generated,
            "rollout/tokens_per_s": sampled.tokens_per_s,
        }
        metrics = self._metrics(completions, scores) | timing
        return Generation(rows, metrics, _tokens(completions))

    def _read(self, first: int) -> Generation:
        """The generation that step ``first`` drew, read back from ``rollouts/<first>.jsonl``
        (a run resumed inside it): its rows and metrics as drawn (what the reward functions
        logged with ``log_metric`` aside)."""
        width = self.trainer.rl.max_completion_length if self._logps is not None else None
        names = [f.name for f in self.functions]
        kept = read_rollouts(self.out_dir / ROLLOUTS, first, self.end_ids, names, width)
        rows = self._rows(kept.completions, kept.advantages, kept.old_logps)
        metrics = self._metrics(kept.completions, kept.scores)
        return Generation(rows, metrics, _tokens(kept.completions))

    def _metrics(self, completions: Completions, scores: Scores) -> dict[str, float]:
        """TRL's metrics of a generation batch: its rewards (each function's, their weighted
        sum, the groups of equal rewards) and its completion lengths."""
        rl = self.trainer.rl
        advantages = group_advantages(scores.total, rl.num_generations, rl.scale_rewards)
        return {
            **scores.metrics(),
            "reward": advantages.reward,
            "reward_std": advantages.reward_std,
            "frac_reward_zero_std": advantages.frac_reward_zero_std,
            **_length_metrics(completions),
        }

    def _generate(self, params: Any, chosen: np.ndarray, seed: int) -> Sampled:
        """``rl.num_generations`` completions of each prompt of ``chosen`` (indices), drawn
        from ``params`` (storage layout) in the compute layout."""
        trainer = self.trainer
        self.generator.params = jax.device_put(params, trainer.layouts.compute)
        prompts = [self.prompt_ids[i] for i in chosen]
        end = np.asarray(self.end_ids, np.int64)
        generated = self.generator.generate_ids(
            prompts,
            max_new_tokens=trainer.rl.max_completion_length,
            sampling=self.sampling,
            seed=seed,
            num_samples=trainer.rl.num_generations,
            # Every id of the model's vocabulary, as transformers' generate and the training
            # log-probabilities have it (ids the tokenizer lacks decode to nothing).
            num_valid=self.generator.decoder.vocab_size,
            width=trainer.prompt_width,
            stop=(lambda ids: bool(np.isin(ids, end).any(axis=1).all())) if end.size else None,
        )
        self.generator.params = None
        rows = [p for p in prompts for _ in range(trainer.rl.num_generations)]
        completions = cut_at_end(rows, generated.ids, generated.logps, self.end_ids)
        return Sampled(completions, generated.tokens_per_s)

    def _scores(
        self, completions: Completions, records: list[PromptRecord], texts: list[str], *, step: int
    ) -> Scores:
        return score(
            self.functions,
            self.trainer.rl.weights,
            prompts=[r.prompt for r in records],
            completions=[completion_for(r, t) for r, t in zip(records, texts, strict=True)],
            completion_ids=completions.ids,
            columns=reward_columns(records),
            step=step,
        )

    def _rows(
        self, completions: Completions, advantages: np.ndarray, old: np.ndarray | None
    ) -> np.ndarray:
        """The rows of a generation batch, with TRL's loss and metric weights (times the
        completions of a step, which the step divides by)."""
        rl, plan = self.trainer.rl, self.trainer.batch_plan
        width = rl.max_completion_length
        trained = completions.trained(mask_truncated=rl.mask_truncated_completions, width=width)
        steps, accumulation = rl.steps_per_generation, plan.accumulation_steps
        per_step = plan.global_batch_size
        loss_weights = aggregation_weights(
            rl.loss, trained, steps=steps, accumulation=accumulation, max_completion_length=width
        )
        metrics = metric_weights(trained, steps=steps, accumulation=accumulation)
        clips = metric_weights(
            trained,
            steps=steps,
            accumulation=accumulation,
            per_sequence=rl.importance_sampling == "sequence",
        )
        return completion_rows(
            completions,
            trained=trained,
            advantages=advantages,
            loss_weights=loss_weights * per_step,
            metric_weights=metrics * per_step,
            clip_weights=clips * per_step,
            old_logps=old,
            row_tokens=self.trainer.seq_len + 1,
        )

    def _prompts_of(self, index: int) -> np.ndarray:
        """The train prompts (indices) of generation ``index``: the next ``num_prompts`` of
        the train prompts in an order shuffled anew each epoch."""
        train, seed = self.split.train, self.trainer.config.training.seed
        places = index * self.num_prompts + np.arange(self.num_prompts)
        epochs, within = np.divmod(places, train.size)
        orders = {
            e: np.random.default_rng([seed, int(e), _ORDER]).permutation(train.size)
            for e in set(epochs.tolist())
        }
        return np.asarray([train[orders[int(e)][w]] for e, w in zip(epochs, within, strict=True)])

    def _rows_of(self, chosen: np.ndarray) -> list[PromptRecord]:
        """Each completion row's prompt record (prompt-major)."""
        return [self.records[i] for i in chosen for _ in range(self.trainer.rl.num_generations)]

    def _tokens_before(self, first: int) -> int:
        """Prompt and completion tokens of the generations before step ``first`` (a resumed
        run's), from their rollouts files."""
        total = 0
        folder = self.out_dir / ROLLOUTS
        for path in folder.glob("*.jsonl") if folder.is_dir() else ():
            if path.stem.isdigit() and int(path.stem) < first:
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    total += len(record["prompt_ids"]) + len(record["completion_ids"])
        return total

    def _check_lengths(self) -> None:
        width, rl = self.trainer.prompt_width, self.trainer.rl
        long = [i for i, ids in enumerate(self.prompt_ids) if len(ids) > width]
        if long:
            first = self.records[long[0]]
            raise ValueError(
                f"{len(long)} of {len(self.prompt_ids)} prompts have more than {width} tokens "
                f"(the first: {first.where}, {len(self.prompt_ids[long[0]])} tokens), the room "
                f"that rows of training.seq_len={self.trainer.seq_len} tokens leave beside "
                f"rl.max_completion_length={rl.max_completion_length}; raise training.seq_len "
                "(within the model's context), lower rl.max_completion_length, or shorten them"
            )


def check_rollouts(trainer: RLTrainer) -> None:
    """Refuse a batch that is not whole groups of completions and rows with no room for a
    prompt (what a run that reads the model alone, generation or export, never needs)."""
    rl, batch = trainer.rl, trainer.config.training.batch_size
    if batch % rl.num_generations:
        raise ValueError(
            f"training.batch_size={batch} counts completions and must be a multiple of "
            f"rl.num_generations={rl.num_generations} (each prompt's group of completions); set "
            f"training.batch_size to a multiple, e.g. "
            f"{max(1, batch // rl.num_generations) * rl.num_generations}"
        )
    if trainer.prompt_width < 1:
        raise ValueError(
            f"rl.max_completion_length={rl.max_completion_length} leaves no room for a prompt in "
            f"rows of training.seq_len={trainer.seq_len} tokens (prompt + completion); raise "
            "training.seq_len (within the model's context) or lower rl.max_completion_length"
        )


def _seed(seed: int, index: int, stream: int) -> int:
    """A uint32 sampling seed of the run's ``seed``, a generation ``index`` and a ``stream``."""
    return int(np.random.SeedSequence([seed, index, stream]).generate_state(1)[0])


def _per_completion(per_target: np.ndarray, completions: Completions, width: int) -> np.ndarray:
    """Each completion token's value (completions, width) from per-target values
    (completions, seq_len) (target ``j`` is token ``j + 1``)."""
    out = np.zeros((per_target.shape[0], width), np.float32)
    for r, (prompt, ids) in enumerate(zip(completions.prompt_ids, completions.ids, strict=True)):
        start = len(prompt) - 1  # the target position of the first completion token
        out[r, : len(ids)] = per_target[r, start : start + len(ids)]
    return out


def _length_metrics(completions: Completions) -> dict[str, float]:
    """TRL's completion-length metrics."""
    lengths = completions.lengths.astype(np.float64)
    ended = lengths[completions.terminated]
    ended = ended if ended.size else np.zeros(1)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float((~completions.terminated).mean()),
        "completions/mean_terminated_length": float(ended.mean()),
        "completions/min_terminated_length": float(ended.min()),
        "completions/max_terminated_length": float(ended.max()),
    }


def _tokens(completions: Completions) -> int:
    return sum(
        len(p) + len(c) for p, c in zip(completions.prompt_ids, completions.ids, strict=True)
    )


def rollout_data(
    trainer: BaseTrainer, out_dir: Path, *, base_dir: Path | None = None
) -> RolloutData | None:
    """What an RL trainer's steps and evaluation read (its prompts' rollouts); None for every
    other trainer (it reads its corpus)."""
    if not isinstance(trainer, RLTrainer):
        return None
    return RolloutData(trainer, out_dir, base_dir=base_dir)
