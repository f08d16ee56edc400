"""Text from a run's checkpoint, under any sharding policy and device count.

The newest good checkpoint's parameters (not the optimizer state) are restored straight into the
compute layout of the requested policy, and :class:`~theseus.inference.generator.Generator`
completes the prompts (``num_samples`` rows per prompt): every layout gives the same completions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import jax
import numpy as np

from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import is_int
from theseus.inference.codec import Codec, resolve_codec
from theseus.inference.generator import Generator, check_prompt_ids
from theseus.inference.logits import load_run
from theseus.inference.sampling import Sampling


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
