"""Preference records (``prompt``, ``chosen``, ``rejected``) tokenized as TRL's ``DPOTrainer``
tokenizes them.

A record holds three texts (the standard form: prompt and completion are concatenated, the
tokenizer adds its own special tokens, and a completion not ending with the end-of-text token gets
it) or three lists of messages (the conversational form: the prompt rendered by the chat template
with the generation prompt, prompt plus completion without it, neither adding special tokens).
Without ``prompt``, the prompt is what ``chosen`` and ``rejected`` share at their start, found as
TRL's ``extract_prompt`` finds it. The three texts are encoded, and the completion begins where
the prompt's tokens and the prompt-plus-completion tokens first differ, whichever side differs
first: both examples of a pair keep the same prompt tokens, the mask is 1 on every token after.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import numpy as np

from theseus.tokenization.chat.batches import EncodedBatch, RawRecord
from theseus.tokenization.chat.encoder import ChatEncoder, utf8_size
from theseus.tokenization.chat.records import checked_messages, decoded, tools_of

LongPrompts = Literal["error", "drop"]  # a prompt over --seq-len: stop, or leave the pair out
SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class TextPair:
    """A prompt and two completions, all plain text."""

    document: int
    prompt: str
    chosen: str
    rejected: str
    where: str


@dataclass(frozen=True)
class ConversationPair:
    """Prompt messages and two completions (lists of messages), rendered by the chat template."""

    document: int
    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    tools: list | None
    where: str


Pair = TextPair | ConversationPair


@dataclass(frozen=True)
class PromptLimit:
    """``--seq-len``: a pair whose prompt is longer (no completion token would train in a row of
    ``seq_len + 1`` tokens) stops tokenizing, or is left out (``drop``); None: no limit."""

    seq_len: int | None
    overlong: LongPrompts


@dataclass(frozen=True)
class EncodedPair:
    """A pair's ids, each beginning with the same ``prompt_length`` prompt tokens."""

    chosen: np.ndarray  # (chosen tokens,) int32
    rejected: np.ndarray  # (rejected tokens,) int32
    prompt_length: int
    sizes: tuple[int, int]  # UTF-8 bytes of each side's text (prompt and completion)


def is_preference_record(record: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(record, dict) and ("chosen" in record or "rejected" in record)


def parse_pair(raw: object, document: int, where: str) -> Pair:
    """A decoded record as a pair, checked (an implicit prompt extracted); a field holding
    null is absent (Parquet rows and datasets hold null for a field another record has)."""
    if isinstance(raw, dict):
        raw = {key: value for key, value in raw.items() if value is not None}
    lacking = [side for side in SIDES if not isinstance(raw, dict) or side not in raw]
    if lacking:
        keys = ", ".join(map(repr, raw)) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(
            f"{where}: the preference record has no {' and no '.join(map(repr, lacking))} (it "
            f"has {keys or 'nothing'}); give every record a 'chosen' and a 'rejected' completion, "
            "with a 'prompt' or with chosen and rejected conversations that share their first "
            "messages"
        )
    assert isinstance(raw, dict)
    chosen, rejected = raw["chosen"], raw["rejected"]
    fields = {name: raw[name] for name in ("prompt", *SIDES) if name in raw}
    if all(isinstance(value, str) for value in fields.values()):
        if "prompt" in raw:
            return TextPair(document, raw["prompt"], chosen, rejected, where)
        shared = shared_prompt(chosen, rejected)
        return TextPair(document, chosen[:shared], chosen[shared:], rejected[shared:], where)
    if not all(isinstance(value, list) for value in fields.values()):
        kinds = ", ".join(f"{name} {type(value).__name__}" for name, value in fields.items())
        raise ValueError(
            f"{where}: the record mixes texts and lists of messages ({kinds}); give all of "
            "'prompt', 'chosen' and 'rejected' as texts or all as lists of messages (drop "
            "'prompt' when the conversations hold it as their first messages)"
        )
    tools = tools_of(raw, where)
    chosen = checked_messages(chosen, where, "chosen")
    rejected = checked_messages(rejected, where, "rejected")
    if "prompt" in raw:
        prompt = checked_messages(raw["prompt"], where, "prompt")
        return ConversationPair(document, prompt, chosen, rejected, tools, where)
    shared = shared_prompt(chosen, rejected)
    if not shared:
        raise ValueError(
            f"{where}: 'chosen' and 'rejected' share no first message, so the record has no "
            "prompt; give it a 'prompt' or begin both conversations with the prompt's messages"
        )
    return ConversationPair(
        document, chosen[:shared], chosen[shared:], rejected[shared:], tools, where
    )


def shared_prompt(chosen: Sequence, rejected: Sequence) -> int:
    """How many leading items (characters or messages) of ``chosen`` form the prompt, as TRL's
    ``extract_prompt`` decides: up to the first item that differs, less a space just before it;
    when one side begins the other, all but the shorter side's last item."""
    same = (a == b for a, b in zip(chosen, rejected, strict=False))
    shared = sum(1 for _ in itertools.takewhile(bool, same))
    if shared == min(len(chosen), len(rejected)):
        return max(shared - 1, 0)
    return shared - 1 if shared and chosen[shared - 1] == " " else shared


def encode_pair_batch(
    limit: PromptLimit, encoder: ChatEncoder, records: list[RawRecord]
) -> EncodedBatch:
    """Decode, render and encode a batch of preference records (``functools.partial(
    encode_pair_batch, limit)`` is a batch encoder of :mod:`.batches`); pairs over ``limit``
    are left out or refused."""
    pairs = [
        parse_pair(decoded(raw, where), document, where) for _, raw, document, where in records
    ]
    encoded = encode_pairs(encoder, pairs)
    kept = [k for k, pair in enumerate(encoded) if _within(limit, pair, pairs[k].where)]
    sides = [getattr(encoded[k], side) for k in kept for side in SIDES]
    masks = [
        np.arange(ids.size) >= encoded[k].prompt_length
        for k, ids in zip(np.repeat(kept, 2), sides, strict=True)
    ]
    return EncodedBatch(
        [records[k][0] for k in kept for _ in SIDES],
        [records[k][2] for k in kept for _ in SIDES],
        np.concatenate(sides or [np.zeros(0, np.int32)]),
        np.concatenate(masks or [np.zeros(0, bool)]).astype(np.uint8),
        np.asarray([ids.size for ids in sides], np.int64),
        [encoded[k].sizes[s] for k in kept for s in (0, 1)],
        [side == "rejected" for _ in kept for side in SIDES],
    )


def _within(limit: PromptLimit, pair: EncodedPair, where: str) -> bool:
    """Whether ``pair``'s prompt fits ``limit`` (False: drop it); an error when it must."""
    if limit.seq_len is None or pair.prompt_length <= limit.seq_len:
        return True
    if limit.overlong == "drop":
        return False
    raise ValueError(
        f"{where}: the prompt has {pair.prompt_length} tokens, longer than --seq-len "
        f"{limit.seq_len}, so none of the pair's completion tokens would train in a row of "
        f"{limit.seq_len + 1} tokens; shorten the prompt, raise --seq-len (and "
        "training.seq_len), or pass --overlong drop to leave such pairs out (counted in "
        "tokens.json)"
    )


def encode_pairs(encoder: ChatEncoder, pairs: list[Pair]) -> list[EncodedPair]:
    """Each pair's ids and prompt length, as TRL's ``DPOTrainer`` tokenizes it."""
    texts = [_texts(encoder, pair) for pair in pairs]  # (prompt, prompt + chosen, ... rejected)
    ids: list = [None] * len(pairs)
    for special in (False, True):  # conversations: the template writes the special tokens
        chosen = [k for k, pair in enumerate(pairs) if isinstance(pair, TextPair) == special]
        flat = [text for k in chosen for text in texts[k]]
        encodings = encoder.tokenizer.encode_batch_fast(flat, add_special_tokens=special)
        for place, k in enumerate(chosen):
            ids[k] = [np.asarray(e.ids, np.int32) for e in encodings[3 * place : 3 * place + 3]]
    return [_pair(pair, ids[k], texts[k]) for k, pair in enumerate(pairs)]


def _texts(encoder: ChatEncoder, pair: Pair) -> tuple[str, str, str]:
    """The prompt, prompt + chosen and prompt + rejected as TRL renders them."""
    if isinstance(pair, TextPair):
        eos = encoder.eos_token
        ends = [c if c.endswith(eos) else c + eos for c in (pair.chosen, pair.rejected)]
        return pair.prompt, pair.prompt + ends[0], pair.prompt + ends[1]
    template = encoder.template
    if template is None:
        raise ValueError(
            f"{pair.where} is a conversation, but tokenizer folder {encoder.folder.path} has no "
            "chat template (neither chat_template.jinja nor a chat_template in "
            "tokenizer_config.json); pass the template with --chat-template FILE"
        )
    try:
        prompt = template.render(pair.prompt, tools=pair.tools, add_generation_prompt=True)
        chosen, rejected = (
            template.render(pair.prompt + side, tools=pair.tools, add_generation_prompt=False)
            for side in (pair.chosen, pair.rejected)
        )
    except ValueError as error:
        raise ValueError(f"{pair.where}: {error}") from None
    return prompt, chosen, rejected


def _pair(pair: Pair, ids: list[np.ndarray], texts: tuple[str, str, str]) -> EncodedPair:
    """The pair from the ids of its prompt, prompt + chosen and prompt + rejected, checked:
    each side adds a token after the shared prompt, and the two completions differ."""
    prompt, chosen, rejected = ids
    length = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    for side, side_ids in zip(SIDES, (chosen, rejected), strict=True):
        if side_ids.size <= length:
            raise ValueError(
                f"{pair.where}: the {side} completion adds no token after the prompt's "
                f"{length} (the template or tokenizer dropped it); give it a non-empty reply"
            )
    if np.array_equal(chosen, rejected):
        raise ValueError(
            f"{pair.where}: the chosen and rejected completions are identical after the chat "
            f"template and the tokenizer ran ({chosen.size - length} tokens, "
            f"{texts[1][-80:]!r}), so the pair prefers nothing; fix or remove the record"
        )
    return EncodedPair(chosen, rejected, length, (utf8_size(texts[1]), utf8_size(texts[2])))


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
