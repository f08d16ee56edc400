"""A theseus run as a model of EleutherAI's lm-evaluation-harness (``lm_eval``, the ``eval`` extra).

:class:`TheseusLM` implements the harness's language-model interface over a run directory, under
the run's policy merged with the caller's layout changes: ``loglikelihood`` and
``loglikelihood_rolling`` through :class:`theseus.inference.scoring.Scorer` (float32, a few fixed
batch shapes, parameters in their storage layout), ``generate_until`` through the KV-cache
decoder with the task's stop sequences. Text is tokenized as the harness's Hugging Face backend
does (the run's ``tokenizer.json``, special tokens added; the end-of-text token from
``tokenizer_config.json``), so both give the same requests; generations end on the folder's
end-of-sequence ids, as the backend's ``generate`` ends them. ``import theseus`` registers the
class as the harness's model ``theseus`` (lazily: this module is imported on first use), so
``lm_eval.simple_evaluate(model="theseus", model_args="run=RUN_DIR,tp=2,fsdp=True", ...)`` works.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from theseus.config import is_int
from theseus.data.tokens import TOKENIZER_FILE
from theseus.inference.generator import Generator
from theseus.inference.logits import load_run
from theseus.inference.sampling import Sampling
from theseus.inference.scoring import Scorer, bucket_widths
from theseus.tokenization.folder import TokenizerFolder
from theseus.training.trainer import BaseTrainer

#: Requests a batch holds on each replica unless ``batch_size`` says otherwise.
ROWS_PER_REPLICA = 4
#: What the harness's Hugging Face backend generates at most unless a task says otherwise.
MAX_GEN_TOKS = 256
#: Generation settings a task may give besides ``until`` and ``max_gen_toks``.
SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p")


@dataclass(frozen=True)
class HarnessTokenizer:
    """A run's tokenizer folder with the ids the harness needs: end of text (the tokenizer's
    ``eos_token``, the backend's ``eot_token_id``), the prefix of an empty context (the
    beginning-of-text token when there is one, else end of text), and the ids that end a
    generation."""

    folder: TokenizerFolder
    eot_id: int
    prefix_id: int
    eos_ids: tuple[int, ...]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.folder.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.folder.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def find_tokenizer(run_dirs: Sequence[Path], data_path: str | None) -> HarnessTokenizer:
    """The tokenizer folder of ``run_dirs`` (a run, then its base) or of the tokenized folder it
    trained on (``data_path``), found by :meth:`TokenizerFolder.find`."""
    folder = TokenizerFolder.find(None, [*run_dirs, data_path])
    if folder is None:
        raise ValueError(
            f"{run_dirs[0]} has no tokenizer: no {TOKENIZER_FILE} in "
            f"{', '.join(str(f) for f in [*run_dirs, data_path] if f)}; the evaluation "
            "harness's tasks are text. Evaluate a run trained on a `theseus tokenize` folder or "
            f"imported from Hugging Face (or copy the tokenizer's {TOKENIZER_FILE} and "
            "tokenizer_config.json into the run)"
        )
    _, eos = folder.eos_token()
    bos = folder.special_tokens.get("bos_token")
    bos_id = None if bos is None else folder.tokenizer.token_to_id(bos)
    prefix = bos_id if bos_id is not None else eos
    return HarnessTokenizer(folder, eos, prefix, folder.eos_ids)


@dataclass(frozen=True)
class HarnessModel:
    """What the harness scores: a trainer, its parameters in the storage layout, the tokenizer,
    and what the results record about them."""

    trainer: BaseTrainer
    params: Any
    tokenizer: HarnessTokenizer
    info: dict[str, Any]


def load_harness_model(
    run_dir: str | Path,
    *,
    policy_changes: dict[str, Any] | None = None,
    devices: Sequence[jax.Device] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
) -> HarnessModel:
    """The newest good checkpoint of ``run_dir`` in the storage layout of its policy merged with
    ``policy_changes`` on ``devices`` (default: all; see
    :func:`theseus.inference.logits.load_run`), with its tokenizer."""
    run_dir = Path(run_dir)
    loaded = load_run(
        run_dir,
        layout="storage",
        policy_changes=policy_changes,
        devices=devices,
        job=job,
        base=base,
    )
    trainer = loaded.trainer
    run_dirs = [run_dir, *([loaded.base_dir] if loaded.base_dir else [])]
    tokenizer = find_tokenizer(run_dirs, trainer.config.data.path)
    info = {
        "run": str(run_dir),
        "job": loaded.job,
        "step": loaded.step,
        "policy": trainer.policy.describe(),
        "tokenizer": str(tokenizer.folder.tokenizer_file),
    }
    return HarnessModel(trainer, loaded.params, tokenizer, info)


class TheseusLM(TemplateLM):
    """The harness's language-model interface over a theseus run (see the module docstring).

    ``run`` is the run directory; ``tp``, ``zero``, ``fsdp`` and ``experts`` (a mixture of
    experts' placement: none, shard, batch or both) change its layout; ``job`` and
    ``base`` as :func:`theseus.inference.logits.load_run`; ``batch_size`` is the requests a batch
    holds (rounded up to a multiple of the replicas; default 4 a replica).
    """

    def __init__(
        self,
        run: str | Path,
        tp: int | None = None,
        zero: bool | None = None,
        fsdp: bool | None = None,
        experts: str | None = None,
        job: str | None = None,
        base: str | Path | None = None,
        batch_size: int | None = None,
    ):
        given = {"tp": tp, "zero": zero, "fsdp": fsdp, "experts": experts}
        changes = {name: value for name, value in given.items() if value is not None}
        model = load_harness_model(run, policy_changes=changes, job=job, base=base)
        self._bind(model, batch_size)

    @classmethod
    def of(cls, model: HarnessModel, *, batch_size: int | None = None) -> TheseusLM:
        """The harness's model over parameters already loaded (e.g. a training run's own)."""
        lm = cls.__new__(cls)
        lm._bind(model, batch_size)
        return lm

    def _bind(self, model: HarnessModel, batch_size: int | None) -> None:
        super().__init__()
        replicas = model.trainer.topology.replicas
        if batch_size is None:
            per_replica = ROWS_PER_REPLICA
        elif not is_int(batch_size) or batch_size < 1:
            raise ValueError(
                f"batch_size={batch_size!r} must be a whole number of requests >= 1 (theseus "
                "batches in fixed shapes: no 'auto')"
            )
        else:
            per_replica = -(-int(batch_size) // replicas)
        self.model = model
        self.scorer = Scorer(model.trainer, model.params, rows_per_replica=per_replica)
        self.codec = model.tokenizer
        self.decoding: Generator | None = None  # made at the first generation, then kept

    def use(self, model: HarnessModel) -> None:
        """Score ``model`` from now on: other parameters of the same trainer (a training run's
        at another step), so the compiled programs are kept."""
        assert model.trainer is self.model.trainer, "use() takes parameters of the same trainer"
        self.model = model
        self.scorer.params = model.params

    # The harness's tokenization, as its Hugging Face backend does it.

    @property
    def eot_token_id(self) -> int:
        return self.codec.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self.codec.prefix_id

    @property
    def max_length(self) -> int:
        return self.scorer.context_len

    @property
    def tokenizer_name(self) -> str:
        return str(self.codec.folder.tokenizer_file)

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        if add_special_tokens is None:  # text that starts with the prefix token has it already
            prefix = self.codec.decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = not string.startswith(prefix)
        return self.codec.encode(string, add_special_tokens=add_special_tokens)

    def get_model_info(self) -> dict[str, Any]:
        return dict(self.model.info)

    # Scoring.

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        scores = self.scorer.score(
            [(context, continuation) for _, context, continuation in requests]
        )
        answers = [(s.logprob, s.is_greedy) for s in scores]
        for (request, _, _), answer in zip(requests, answers, strict=True):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, scored in windows of the model's context (each token
        predicted once, with as much context as fits), as the harness defines it."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            rolling = harness_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(harness_utils.make_disjoint_window, rolling):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, score in zip(owners, self.scorer.score(windows), strict=True):
            totals[owner] += score.logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # Generation.

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's completion, cut at the first of the task's stop sequences (and the
        end-of-text token), at most ``max_gen_toks`` tokens; requests with the same generation
        settings share batches."""
        if not requests:
            return []
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True), []).append(index)
        results: list[str] = [""] * len(requests)
        generator = self._generator()
        try:
            for indices in groups.values():
                settings = requests[indices[0]].args[1]
                contexts = [requests[i].args[0] for i in indices]
                texts = self._generate(generator, contexts, settings)
                for index, text in zip(indices, texts, strict=True):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
        finally:
            generator.params = None  # the compute-layout copy lives for this call only
        return results

    def _generator(self) -> Generator:
        """The generator (its compiled steps kept from call to call) over the parameters in
        the compute layout: the KV-cache decoder reads whole layers."""
        trainer = self.model.trainer
        params = jax.device_put(self.model.params, trainer.layouts.compute)
        if self.decoding is None:
            self.decoding = Generator(trainer, params)
        self.decoding.params = params
        return self.decoding

    def _generate(self, generator: Generator, contexts: list[str], settings: dict) -> list[str]:
        kwargs = dict(normalize_gen_kwargs(settings, MAX_GEN_TOKS))
        eos = self.codec.decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        sampling = _sampling(kwargs)
        room = self.max_length - max_gen_toks
        if room < 1:
            raise ValueError(
                f"max_gen_toks={max_gen_toks} leaves no room for a prompt in the model's context "
                f"of {self.max_length} tokens; ask for fewer new tokens"
            )
        prompts = [self.tok_encode(text)[-room:] for text in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        rows = self.scorer.rows
        texts: list[str] = [""] * len(prompts)
        for start in range(0, len(order), rows):
            chunk = order[start : start + rows]
            batch = [prompts[i] for i in chunk]
            batch += [batch[0]] * (rows - len(batch))  # idle rows: one shape for every batch
            longest = max(len(p) for p in batch)
            width = next(w for w in bucket_widths(self.max_length) if w >= longest)

            def stopped(ids: np.ndarray, count: int = len(chunk)) -> bool:
                return all(self._stops(row.tolist(), until) for row in ids[:count])

            generated = generator.generate_ids(
                batch, max_new_tokens=max_gen_toks, sampling=sampling, width=width, stop=stopped
            )
            for row, index in enumerate(chunk):
                texts[index] = self._completion(generated.ids[row].tolist(), until)
        return texts

    def _stops(self, ids: list[int], until: list[str]) -> bool:
        """Whether ``ids`` hold an end-of-sequence id or a stop sequence."""
        if _first_end(ids, self.codec.eos_ids) is not None:
            return True
        text = self.codec.decode(ids)
        return any(stop and stop in text for stop in until)

    def _completion(self, ids: list[int], until: list[str]) -> str:
        """The text of ``ids`` up to the first end-of-sequence id, cut at the first stop
        sequence."""
        end = _first_end(ids, self.codec.eos_ids)
        ids = ids if end is None else ids[:end]
        return postprocess_generated_text(self.codec.decode(ids), until, None)


def _first_end(ids: list[int], eos_ids: Sequence[int]) -> int | None:
    """The position of the first of ``eos_ids`` in ``ids``, None when there is none."""
    return next((i for i, token in enumerate(ids) if token in eos_ids), None)


def _sampling(kwargs: dict[str, Any]) -> Sampling:
    """The task's sampling settings (greedy unless it samples); others are refused by name."""
    unknown = sorted(set(kwargs) - set(SAMPLING_KWARGS))
    if unknown:
        raise ValueError(
            f"generation settings {', '.join(unknown)} are not supported by theseus's decoder "
            f"(it takes until, max_gen_toks, {', '.join(SAMPLING_KWARGS)}); remove them from the "
            "task's generation_kwargs"
        )
    if not kwargs.get("do_sample"):
        return Sampling(temperature=0.0)
    return Sampling(
        temperature=float(kwargs.get("temperature", 1.0)),
        top_k=kwargs.get("top_k"),
        top_p=kwargs.get("top_p"),
    )
