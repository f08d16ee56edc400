"""Token ids from a trainer's model under any layout: the KV-cache generator that ``theseus
generate``, the harness's ``generate_until`` and RL rollouts share.

Prompts of different lengths are right-padded into one batch of rows split over ``batch``; the KV
cache is for a fixed length (prompt width + new tokens), its rows over ``batch`` and its heads
over ``shard``. One compiled prefill fills the cache and picks each row's first token; one
compiled decode step, called once per further token, writes one position per row and picks the
next. Row ``r`` reads its own positions only, so padding never changes a result, and its sampling
key depends on ``(seed, r, position)`` only: every layout gives the same completions. Each chosen
token comes with its log-probability under the distribution it was drawn from (after the
temperature and any top-k/top-p truncation).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.config import check_int
from theseus.inference.programs import Program, ProgramCache, global_array
from theseus.inference.sampling import Sampling, next_tokens, sample_keys
from theseus.model.decode import ROWS
from theseus.sharding.axis import Axis, Rule, ShardingPlan, ShardingPolicy, partition_spec
from theseus.sharding.layout import abstract_with
from theseus.training.trainer import BaseTrainer

logger = logging.getLogger(__name__)

#: How often (in new tokens) ``Generator.generate_ids`` asks its ``stop`` whether to end: each
#: question waits for the device, so it is not asked at every token.
STOP_EVERY = 8


@dataclass(frozen=True)
class GeneratedIds:
    """What :meth:`Generator.generate_ids` returns."""

    ids: np.ndarray  # (prompts × num_samples rows, prompt-major; new tokens)
    logps: np.ndarray  # (rows, new tokens) float32: each id's log-probability where it was drawn
    tokens_per_s: float  # generated tokens per second, prefill included, compilation excluded
    notes: list[str]  # what the user should know (a shortened generation, idle rows)


class Generator:
    """A trainer's model with parameters in the compute layout, ready to decode token ids."""

    def __init__(self, trainer: BaseTrainer, params: Any):
        decoder = trainer.decoder()
        if decoder is None:
            raise TypeError(
                f"{type(trainer).__name__} cannot generate: its decoder() returns None; override "
                "it to return an object with the interface of theseus.model.decode.Decoder"
            )
        self.trainer = trainer
        self.decoder = decoder
        self.params = params
        self.mesh = trainer.mesh
        self.rules = cache_rules(trainer.plan, trainer.policy)
        self._programs = ProgramCache(trainer.topology.device_mesh)
        self.replicated = NamedSharding(self.mesh, P())

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        seed: int = 0,
        num_samples: int = 1,
        num_valid: int | None = None,
        width: int | None = None,
        stop: Callable[[np.ndarray], bool] | None = None,
    ) -> GeneratedIds:
        """New token ids of every prompt's ``num_samples`` rows, the rate and notes for the
        user. Ids from ``num_valid`` (default: the whole vocabulary) on are never chosen.
        ``width`` right-pads the prompts to that many positions (default: the longest prompt's),
        so that batches of other prompt lengths share one compiled prefill and step; ``stop``,
        given the new ids so far (rows, n) every :data:`STOP_EVERY` tokens, ends the generation
        early when it returns True."""
        lengths = self._check(prompts, max_new_tokens, num_samples)
        check_int("seed", seed, minimum=0, maximum=2**32 - 1)
        num_valid = self.decoder.vocab_size if num_valid is None else num_valid
        context = self.decoder.context_len
        notes = []
        new = min(max_new_tokens, context - max(lengths))
        if new < max_new_tokens:
            notes.append(
                f"stopped at the context length {context}: the longest prompt has "
                f"{max(lengths)} tokens, so each row gets {new} new tokens, not {max_new_tokens}"
            )
        num_rows = len(prompts) * num_samples
        replicas = self.trainer.topology.replicas
        padded = math.ceil(num_rows / replicas) * replicas
        if padded > num_rows:
            notes.append(f"{num_rows} rows on {replicas} replicas: {padded - num_rows} idle row(s)")
        for note in notes:
            logger.info(f"note: {note}")
        width = max(lengths) if width is None else width
        if not max(lengths) <= width <= context:
            raise ValueError(
                f"width={width} must hold the longest prompt ({max(lengths)} tokens) and lie "
                f"within the model's context of {context} positions"
            )
        tokens = np.zeros((padded, width), np.int32)  # (rows, width): right-padded prompts
        row_lengths = np.ones(padded, np.int32)
        for row in range(num_rows):
            prompt = prompts[row // num_samples]
            tokens[row, : len(prompt)] = prompt
            row_lengths[row] = len(prompt)
        prefill, step = self.compiled(padded, width, width + new, num_valid)
        row_sharding = NamedSharding(self.mesh, P(Axis.BATCH))
        controls = {"seed": np.uint32(seed), **sampling.arrays()}
        # Every process holds the same prompts; each places the rows of its own devices.
        inputs = (
            global_array(tokens, NamedSharding(self.mesh, P(Axis.BATCH, None))),
            global_array(row_lengths, row_sharding),
            global_array(np.arange(padded, dtype=np.int32), row_sharding),
            jax.tree.map(lambda c: global_array(np.asarray(c), self.replicated), controls),
        )
        start = time.perf_counter()
        token, cache, positions = prefill(self.params, *inputs)
        chosen = [token]
        for _ in range(new - 1):
            if (
                stop is not None
                and len(chosen) % STOP_EVERY == 0
                and stop(_stacked([c.ids for c in chosen], num_rows))
            ):
                break
            token, cache, positions = step(self.params, cache, token.ids, positions, *inputs[2:])
            chosen.append(token)
        ids = _stacked([c.ids for c in chosen], num_rows)  # (rows, new tokens)
        logps = _stacked([c.logps for c in chosen], num_rows)  # (rows, new tokens)
        seconds = time.perf_counter() - start
        return GeneratedIds(ids, logps, ids.size / seconds, notes)

    def _check(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, num_samples: int
    ) -> list[int]:
        if not prompts:
            raise ValueError("no prompts given; pass at least one (--prompt TEXT)")
        for name, value in (("max_new_tokens", max_new_tokens), ("num_samples", num_samples)):
            check_int(name, value, minimum=1)
        context = self.decoder.context_len
        lengths = [len(p) for p in prompts]
        for index, length in enumerate(lengths):
            if length == 0:
                raise ValueError(f"prompt {index} is empty; give each prompt at least one token")
            check_prompt_ids(index, prompts[index], self.decoder.vocab_size)
            if length >= context:
                raise ValueError(
                    f"prompt {index} has {length} tokens, but the model reads at most {context} "
                    "positions and needs one for a new token; shorten the prompt"
                )
        return lengths

    def compiled(
        self, num_rows: int, width: int, cache_len: int, num_valid: int
    ) -> tuple[jax.stages.Compiled, ...]:
        """The prefill and the decode step for this batch shape, compiled once each (nothing
        allocated: ``theseus plan --compile`` reads their ``memory_analysis()``)."""
        key = (num_rows, width, cache_len, num_valid)
        return self._programs(key, lambda: self._programs_for(*key))

    def _programs_for(
        self, num_rows: int, width: int, cache_len: int, num_valid: int
    ) -> tuple[Program, Program]:
        decoder = self.decoder
        arrays = decoder.cache(num_rows, cache_len)
        cache_layout = jax.tree.map(
            lambda a: NamedSharding(self.mesh, partition_spec(a.names, self.rules)), arrays
        )
        rows = NamedSharding(self.mesh, P(Axis.BATCH))
        replicated = self.replicated

        def prefill(params, tokens, lengths, row_ids, controls):
            cache = jax.tree.map(
                lambda a, layout: jax.lax.with_sharding_constraint(
                    jnp.full(a.shape, a.fill, a.dtype), layout
                ),
                arrays,
                cache_layout,
            )
            logits, cache = decoder(params, cache, tokens, jnp.zeros_like(lengths), lengths)
            keys = sample_keys(controls["seed"], row_ids, lengths)
            return next_tokens(logits, keys, controls, num_valid), cache, lengths

        def step(params, cache, token, positions, row_ids, controls):
            logits, cache = decoder(params, cache, token[:, None], positions)
            keys = sample_keys(controls["seed"], row_ids, positions + 1)
            chosen = next_tokens(logits, keys, controls, num_valid)
            return chosen, cache, positions + 1

        params = abstract_with(self.trainer.abstract_state.params, self.trainer.layouts.compute)
        row_ints = jax.ShapeDtypeStruct((num_rows,), jnp.int32, sharding=rows)
        controls = {
            name: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
            for name, dtype in (
                ("seed", jnp.uint32),
                ("temperature", jnp.float32),
                ("top_k", jnp.int32),
                ("top_p", jnp.float32),
            )
        }
        tokens_sharding = NamedSharding(self.mesh, P(Axis.BATCH, None))
        tokens = jax.ShapeDtypeStruct((num_rows, width), jnp.int32, sharding=tokens_sharding)
        cache = abstract_with(arrays, cache_layout)
        chosen = jax.ShapeDtypeStruct((num_rows,), jnp.int32, sharding=replicated)
        # The chosen ids come out whole on every device, so every process reads them.
        outputs = (replicated, cache_layout, rows)  # the ids and their log-probabilities
        return (
            Program(prefill, (params, tokens, row_ints, row_ints, controls), outputs),
            Program(step, (params, cache, chosen, row_ints, row_ints, controls), outputs, (1,)),
        )


def cache_rules(plan: ShardingPlan, policy: ShardingPolicy) -> tuple[Rule, ...]:
    """How the cache's logical names resolve under ``policy``: the model's compute rules (its
    key and value heads as training splits their projections) and its rows over ``batch``."""
    return (*plan.rules(policy, "compute"), (ROWS, Axis.BATCH))


def _stacked(chosen: list[jax.Array], num_rows: int) -> np.ndarray:
    """What was chosen so far, one (rows,) array a step, as (num_rows, steps)."""
    return np.stack(jax.device_get(chosen), axis=1)[:num_rows]


def check_prompt_ids(index: int, ids: Sequence[int], vocab_size: int) -> None:
    """Every id of prompt ``index`` lies in the model's vocabulary; else an error naming one."""
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(
            f"prompt {index} has token id {outside[0]}, outside the model's vocabulary of "
            f"{vocab_size} ids (0..{vocab_size - 1}); give ids below {vocab_size}, or text "
            "encoded with the run's tokenizer"
        )
