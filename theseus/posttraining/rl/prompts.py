"""The prompts of online RL, read, encoded and answered as TRL's ``GRPOTrainer`` (1.16) does.

A prompt file is JSON Lines (plain, gzip or zstd) or Parquet, or a folder of them read in sorted
order; each record has a ``prompt``, text or a list of ``{role, content}`` messages (all records
one kind), and any other fields, kept as the record's ``columns`` for the reward functions.

Encoding follows ``GRPOTrainer._tokenize_prompts``: a text prompt is ``processing_class(text=...)``,
the tokenizer's own encoding with its special tokens (``tokenizer.json``'s post-processor: a Llama
tokenizer's ``bos_token`` first; transformers 5 ignores ``add_bos_token`` and ``add_eos_token``
when the folder has ``tokenizer.json``); a conversation is ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``, the chat
template's text encoded without special tokens. A run without a tokenizer encodes text prompts as
UTF-8 bytes (:class:`~theseus.inference.codec.ByteCodec`). Completions are decoded as TRL decodes
them, ``batch_decode(ids, skip_special_tokens=True)``, and a conversation's completion is one
assistant message (TRL 1.16 keeps no assistant prefix of the prompt; it parses the reply with the
tokenizer's ``response_schema`` when transformers 5 finds one, for tool calls, which is not done
here).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from theseus.config import check_int
from theseus.data.readers import (
    InputFile,
    errors_name,
    jsonl_records,
    list_inputs,
    parquet_rows,
    walk_sorted,
)
from theseus.inference.codec import ByteCodec, TokenizerCodec
from theseus.tokenization.chat.records import checked_messages
from theseus.tokenization.folder import TokenizerFolder

# What encodes a run's text: its tokenizer folder (or the codec holding it), or UTF-8 bytes.
PromptTokenizer = TokenizerFolder | TokenizerCodec | ByteCodec
# Fields TRL never passes to a reward function as columns (GRPOTrainer._calculate_rewards).
NOT_COLUMNS = ("prompt", "completion", "completion_ids")
SALT = 0x9A0B  # keeps the held-out permutation apart from other seeded permutations


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: text or messages, the record's other fields, its number in reading order
    (from 0) and where it is (file and line, or Parquet row)."""

    prompt: str | list[dict[str, Any]]
    columns: dict[str, Any]
    index: int
    where: str

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def read_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    """Every prompt record of ``path`` (a JSON Lines or Parquet file, or a folder of them), in
    order; a ValueError names the file and record of anything wrong."""
    files = _prompt_files(Path(path))
    records: list[PromptRecord] = []
    for item in files:
        with errors_name(item):
            rows = (
                parquet_rows(item)
                if item.kind == "parquet"
                else ((raw, f"{item.path}, line {n}") for raw, n in jsonl_records(item))
            )
            for raw, where in rows:
                records.append(_record(raw, len(records), where))
    if not records:
        raise ValueError(
            f"prompt file {path} holds no records; give it one JSON object (or Parquet row) with "
            "a 'prompt' per line"
        )
    _check_one_kind(records, path)
    return records


def reward_columns(records: list[PromptRecord]) -> dict[str, list[Any]]:
    """The columns a reward function receives for ``records`` (one row each, a prompt repeated
    for each of its completions): every field but those of :data:`NOT_COLUMNS`, as TRL passes a
    dataset's, ``None`` where a record lacks it (as a dataset read from JSON Lines holds it)."""
    names = dict.fromkeys(k for r in records for k in r.columns if k not in NOT_COLUMNS)
    return {name: [r.columns.get(name) for r in records] for name in names}


def encode_prompt(record: PromptRecord, tokenizer: PromptTokenizer) -> list[int]:
    """The token ids of one prompt, as :func:`encode_prompts` encodes it."""
    return encode_prompts([record], tokenizer)[0]


def encode_prompts(records: list[PromptRecord], tokenizer: PromptTokenizer) -> list[list[int]]:
    """The token ids of each prompt, as TRL's ``GRPOTrainer`` tokenizes them: text with the
    tokenizer's special tokens (``tokenizer(text)``), conversations through the chat template
    with the generation prompt; UTF-8 bytes for text without a tokenizer."""
    folder = tokenizer.folder if isinstance(tokenizer, TokenizerCodec) else tokenizer
    conversations = [r for r in records if r.conversational]
    template = None
    if conversations and isinstance(folder, TokenizerFolder):
        template = folder.chat_template()
    if conversations and template is None:
        has = (
            f"tokenizer folder {folder.path} has no chat template (neither chat_template.jinja "
            "nor a chat_template in tokenizer_config.json)"
            if isinstance(folder, TokenizerFolder)
            else "the run has no tokenizer (its text is UTF-8 bytes)"
        )
        raise ValueError(
            f"{conversations[0].where}: the prompt is a conversation, which the model's chat "
            f"template renders, but {has}; pass the model's tokenizer folder with its chat "
            "template, or give the prompts as text"
        )
    ids = []
    for record in records:
        if isinstance(folder, ByteCodec):
            assert isinstance(record.prompt, str)  # conversations were refused above
            ids.append(folder.encode(record.prompt))
        elif isinstance(record.prompt, str):
            ids.append(folder.tokenizer.encode(record.prompt).ids)
        else:
            assert template is not None
            text = template.render(record.prompt, add_generation_prompt=True)
            ids.append(folder.tokenizer.encode(text, add_special_tokens=False).ids)
    return ids


def decode_completion(ids: list[int], tokenizer: PromptTokenizer) -> str:
    """A completion's text as transformers' ``batch_decode(..., skip_special_tokens=True)``
    gives it (special tokens such as the end-of-sequence one left out); bytes decode as
    :meth:`ByteCodec.decode <theseus.inference.codec.ByteCodec.decode>`."""
    if isinstance(tokenizer, ByteCodec):
        return tokenizer.decode(list(ids))
    folder = tokenizer.folder if isinstance(tokenizer, TokenizerCodec) else tokenizer
    return folder.decode(ids, skip_special_tokens=True)


def completion_for(record: PromptRecord, text: str) -> str | list[dict[str, str]]:
    """The completion a reward function receives: the text for a text prompt, one assistant
    message for a conversation (TRL's ``[{"role": "assistant", "content": text}]``)."""
    return [{"role": "assistant", "content": text}] if record.conversational else text


@dataclass(frozen=True)
class Split:
    """Prompt indices that train and those held out for validation, each in increasing order."""

    train: np.ndarray  # (num_train,) int64
    validation: np.ndarray  # (num_validation,) int64


def held_out(n: int, fraction: float, seed: int) -> Split:
    """``n`` prompts split for validation: ``round(n * fraction)`` of them (half rounds up), at
    least one when ``fraction`` > 0 and at most ``n - 1``, those a permutation seeded by
    ``seed`` ranks first. The count is exact, unlike the corpora's block split
    (:class:`~theseus.data.split.DocumentSplit`, which streams), because a prompt set is small
    and its size known; ``fraction`` 0 holds out nothing."""
    check_int("the number of prompts", n, minimum=1)
    check_int("the held-out seed", seed, minimum=0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"the held-out fraction must be a number, got {type(fraction).__name__}")
    if not 0 <= fraction < 1:
        raise ValueError(
            f"the held-out fraction must be at least 0 and below 1, got {fraction}; give the "
            "share of prompts to hold out for validation (0 for none)"
        )
    indices = np.arange(n, dtype=np.int64)
    if fraction == 0:
        return Split(indices, np.empty(0, np.int64))
    if n < 2:
        raise ValueError(
            f"holding out a fraction {fraction} of 1 prompt leaves none to train on; give more "
            "prompts or a held-out fraction of 0"
        )
    count = min(max(math.floor(n * fraction + 0.5), 1), n - 1)
    order = np.random.default_rng([seed, SALT]).permutation(n)  # (n,)
    validation = np.sort(order[:count])
    return Split(np.setdiff1d(indices, validation), validation)


def _prompt_files(root: Path) -> list[InputFile]:
    if not root.exists():
        raise ValueError(
            f"prompt file {str(root)!r} does not exist; pass a JSON Lines (.jsonl, .jsonl.gz, "
            ".jsonl.zst) or Parquet file of records with a 'prompt', or a folder of them"
        )
    files = (
        list_inputs(root.parent, [root.name])
        if root.is_file()
        else list_inputs(root, walk_sorted(root))
    )
    for item in files:
        if item.kind == "text":
            raise ValueError(
                f"{item.path} is neither JSON Lines nor Parquet; prompts come in .jsonl, "
                ".jsonl.gz, .jsonl.zst or .parquet files: convert or remove it"
            )
    return files


def _record(raw: object, index: int, where: str) -> PromptRecord:
    place = f"{where} (record {index})"
    if not isinstance(raw, dict) or "prompt" not in raw:
        has = (
            f"its fields: {', '.join(map(repr, raw)) or 'none'}"
            if isinstance(raw, dict)
            else f"it is a JSON {type(raw).__name__}, not an object"
        )
        raise ValueError(
            f"{place} has no 'prompt' ({has}); give every record a 'prompt', text or a list of "
            "{role, content} messages (rename the field that holds it)"
        )
    prompt = raw["prompt"]
    if isinstance(prompt, list):
        prompt = checked_messages(prompt, place, "prompt")
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{place}: 'prompt' holds {type(prompt).__name__} ({repr(prompt)[:80]}), neither text "
            "nor a list of {role, content} messages; fix the record"
        )
    columns = {key: value for key, value in raw.items() if key != "prompt"}
    return PromptRecord(prompt, columns, index, where)


def _check_one_kind(records: list[PromptRecord], path: str | os.PathLike) -> None:
    """TRL decides text or conversation from the first prompt: every prompt must be that kind."""
    first = records[0]
    other = next((r for r in records if r.conversational != first.conversational), None)
    if other is not None:
        kinds = {True: "a conversation", False: "text"}
        raise ValueError(
            f"the prompts of {path} are of two kinds: record {first.index} ({first.where}) is "
            f"{kinds[first.conversational]} and record {other.index} ({other.where}) is "
            f"{kinds[other.conversational]}; give every prompt as text or every prompt as a "
            "list of {role, content} messages"
        )
