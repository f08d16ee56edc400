"""Text from a run's checkpoint, under any sharding policy and device count.

The newest good checkpoint's parameters (not the optimizer state) are restored straight into the
compute layout of the requested policy. Prompts of different lengths are right-padded into one
batch of rows (``num_samples`` rows per prompt) split over ``batch``; the KV cache is for a fixed
length (longest prompt + new tokens), its rows over ``batch`` and its heads over ``shard``. One
compiled prefill fills the cache and picks each row's first token; one compiled decode step,
called once per further token, writes one position per row and picks the next. Row ``r`` reads
its own positions only, so padding never changes a result, and its sampling key depends on
``(seed, r, position)`` only: every layout gives the same completions.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import check_int, is_int
from theseus.inference.codec import Codec, resolve_codec
from theseus.inference.logits import load_run
from theseus.inference.programs import Program, ProgramCache, global_array
from theseus.inference.sampling import Sampling, next_tokens, sample_keys
from theseus.model.decode import ROWS
from theseus.sharding.axis import Axis, partition_spec
from theseus.sharding.layout import abstract_with
from theseus.training.trainer import BaseTrainer

logger = logging.getLogger(__name__)

#: How often (in new tokens) ``Generator.generate_ids`` asks its ``stop`` whether to end: each
#: question waits for the device, so it is not asked at every token.
STOP_EVERY = 8


class GenerationOptions(TypedDict, total=False):
    """The keywords :func:`generate` and :func:`theseus.inference.chat.generate_chat` share,
    with :func:`generate`'s meanings (``theseus generate`` passes them to either)."""

    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    tokenizer: str | Path | None
    policy_changes: dict[str, Any] | None
    job: str | None
    base: str | Path | None


@dataclass(frozen=True)
class Completion:
    """One sample of one prompt."""

    prompt: str  # as given, or the text its token ids spell
    sample: int
    completion: str
    prompt_ids: list[int]
    token_ids: list[int]


@dataclass(frozen=True)
class Generation:
    """What ``generate`` returns: the completions and how they were made."""

    completions: list[Completion]
    checkpoint_step: int
    new_tokens: int
    tokens_per_s: float
    policy: str
    mesh_shape: dict[str, int]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GeneratedIds:
    """What :meth:`Generator.generate_ids` returns."""

    ids: np.ndarray  # (prompts × num_samples rows, prompt-major; new tokens)
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
        self.rules = (*trainer.plan.rules(trainer.policy, "compute"), (ROWS, Axis.BATCH))
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
        prefill, step = self._compiled(padded, width, width + new, num_valid)
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
                and stop(_stacked(chosen, num_rows))
            ):
                break
            token, cache, positions = step(self.params, cache, token, positions, *inputs[2:])
            chosen.append(token)
        ids = _stacked(chosen, num_rows)  # (rows, new tokens)
        seconds = time.perf_counter() - start
        return GeneratedIds(ids, ids.size / seconds, notes)

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

    def _compiled(self, num_rows: int, width: int, cache_len: int, num_valid: int):
        """The prefill and the decode step for this batch shape, compiled once each."""
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
        outputs = (replicated, cache_layout, rows)
        return (
            Program(prefill, (params, tokens, row_ints, row_ints, controls), outputs),
            Program(step, (params, cache, chosen, row_ints, row_ints, controls), outputs, (1,)),
        )


def _stacked(chosen: list[jax.Array], num_rows: int) -> np.ndarray:
    """The tokens chosen so far, one (rows,) array a step, as (num_rows, steps) ids."""
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


def load_generator(
    run_dir: str | Path,
    *,
    policy_changes: dict[str, Any] | None = None,
    devices: Sequence[jax.Device] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
) -> LoadedGenerator:
    """A :class:`Generator` with the newest good checkpoint of ``run_dir`` in the compute layout
    of the run's policy merged with ``policy_changes`` (or one that fits ``devices``), and that
    checkpoint's metadata; ``job`` and ``base`` as :func:`theseus.inference.logits.load_run`."""
    loaded = load_run(run_dir, policy_changes=policy_changes, devices=devices, job=job, base=base)
    return LoadedGenerator(Generator(loaded.trainer, loaded.params), loaded.meta, loaded.base_dir)


@dataclass(frozen=True)
class LoadedGenerator:
    """What :func:`load_generator` returns: the generator and the metadata of the checkpoint
    whose parameters it holds."""

    generator: Generator
    meta: CheckpointMeta
    base_dir: Path | None = None  # the run a fine-tuning run's base comes from

    @property
    def step(self) -> int:
        return self.meta.step


def generate(
    run_dir: str | Path,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    num_samples: int = 1,
    tokenizer: str | Path | None = None,
    policy_changes: dict[str, Any] | None = None,
    devices: Sequence[jax.Device] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
    stop_ids: Collection[int] = (),
) -> Generation:
    """Complete ``prompts`` with the newest good checkpoint of ``run_dir``.

    A prompt is text or a list of token ids. Text is encoded with ``tokenizer`` (a
    ``tokenizer.json``), else the run's own tokenizer (a run trained on a ``theseus tokenize``
    folder or imported from Hugging Face keeps a copy; a fine-tuning run uses its base's),
    else as UTF-8 bytes; without a tokenizer, ids that are no byte are shown as ``⟨id⟩``.
    ``policy_changes`` (e.g. ``{"tp": 2}``) merge into the run's saved policy; ``devices``
    default to all of JAX's devices; ``job`` and ``base`` as
    :func:`theseus.inference.logits.load_run`. Decoding ends early (checked every
    :data:`STOP_EVERY` tokens) once every row has chosen one of ``stop_ids``; the completions
    keep what was decoded, the stop ids and any tokens after them included.
    """
    sampling = Sampling(temperature, top_k, top_p)  # checked before anything is loaded
    if isinstance(prompts, str) or not all(_is_prompt(p) for p in prompts):
        raise TypeError("prompts must be a list of strings or of lists of int token ids")
    if not prompts or not all(len(p) for p in prompts):
        raise ValueError("give one or more prompts, none of them empty (--prompt TEXT)")
    loaded = load_generator(
        run_dir, policy_changes=policy_changes, devices=devices, job=job, base=base
    )
    generator = loaded.generator
    trainer = generator.trainer
    vocab_size = generator.decoder.vocab_size
    run_dirs = [Path(run_dir), *([loaded.base_dir] if loaded.base_dir else [])]
    codec: Codec = resolve_codec(run_dirs, tokenizer, trainer.config.data.path, vocab_size)
    prompt_ids = [codec.encode(p) if isinstance(p, str) else [int(i) for i in p] for p in prompts]
    for index, ids in enumerate(prompt_ids):
        check_prompt_ids(index, ids, vocab_size)
    texts = [
        p if isinstance(p, str) else codec.decode(ids)
        for p, ids in zip(prompts, prompt_ids, strict=True)
    ]
    generated = generator.generate_ids(
        prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        num_samples=num_samples,
        num_valid=codec.vocab_size,
        stop=_every_row_stopped(stop_ids) if stop_ids else None,
    )
    new_ids = generated.ids  # (rows, new tokens)
    completions = [
        Completion(
            prompt=texts[row // num_samples],
            sample=row % num_samples,
            completion=codec.decode(new_ids[row].tolist()),
            prompt_ids=prompt_ids[row // num_samples],
            token_ids=new_ids[row].tolist(),
        )
        for row in range(new_ids.shape[0])
    ]
    return Generation(
        completions,
        loaded.step,
        int(new_ids.shape[1]),
        generated.tokens_per_s,
        trainer.policy.describe(),
        trainer.topology.mesh_shape,
        generated.notes,
    )


def _every_row_stopped(stop_ids: Collection[int]) -> Callable[[np.ndarray], bool]:
    """Whether every row of the new ids ``(rows, n)`` holds one of ``stop_ids``."""
    wanted = np.asarray(sorted(stop_ids))

    def stopped(ids: np.ndarray) -> bool:
        return bool(np.isin(ids, wanted).any(axis=1).all())

    return stopped


def _is_prompt(prompt: Any) -> bool:
    """Text, or a sequence of int token ids."""
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, Sequence) and all(is_int(i) for i in prompt)
