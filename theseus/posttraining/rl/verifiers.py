"""The built-in reward functions, verifiable checks with TRL's signature (``**kwargs`` takes
the other keywords): ``accuracy`` (the completion's final number against the ``answer`` column)
and ``think_format`` (reasoning in a think block, then an answer). Both are importable as
``theseus.posttraining.rl.rewards:accuracy`` and ``theseus.posttraining.rl.rewards:think_format``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

# A number: digits with thousands separators (1,234,567.5), or plain digits with an optional
# fraction, or a bare fraction (.5); a minus sign directly before it makes it negative.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_BOXED = "\\boxed{"
_GSM8K_MARK = "####"
# TRL's think_format_reward rule (one opening tag, at the very start), then an answer.
_THINK = re.compile(r"^<think>(?!.*<think>).*?</think>\s*\S", re.DOTALL)


def accuracy(completions: list[Any], answer: list[Any], **kwargs) -> list[float | None]:
    """1.0 when a completion's answer equals its row's ``answer`` as a number, else 0.0; None
    (not scored) where the row has no answer or its answer holds no number, as TRL's
    ``accuracy_reward`` skips an answer it cannot parse.

    A completion's answer is the last number of its last ``\\boxed{...}`` when it has one, else
    its last number (a conversational completion's text is its last message's content). The
    ``answer`` is a number, or text: what follows GSM8K's ``####``, else its last
    ``\\boxed{...}``, else the whole text, whose last number counts. Numbers compare exactly as
    decimals, thousands separators removed (``1,234`` is 1234, ``3.0`` equals ``3``)."""
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        wanted = _answer_number(gold)
        if wanted is None:
            rewards.append(None)
            continue
        got = _last_number(_boxed(text := _text(completion)) or text)
        rewards.append(1.0 if got is not None and got == wanted else 0.0)
    return rewards


def think_format(completions: list[Any], **kwargs) -> list[float]:
    """1.0 when a completion starts with ``<think>``, holds no second ``<think>``, closes the
    block with ``</think>`` and has an answer after it (a character other than whitespace),
    else 0.0: the pattern ``^<think>(?!.*<think>).*?</think>\\s*\\S`` over the whole text,
    newlines included (TRL's ``think_format_reward`` with the answer required). A template
    whose generation prompt already opens the think block (DeepSeek-R1's, Qwen3's) makes
    completions without the opening tag: this reward then scores 0.0."""
    return [1.0 if _THINK.match(_text(completion)) else 0.0 for completion in completions]


def _text(completion: Any) -> str:
    """A completion's text: itself, or its last message's content."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def _answer_number(gold: Any) -> Decimal | None:
    if gold is None or isinstance(gold, bool):
        return None
    if isinstance(gold, (int, float)):
        return _decimal(str(gold))
    text = str(gold)
    marked = text.rsplit(_GSM8K_MARK, 1)[1] if _GSM8K_MARK in text else None
    return _last_number(marked if marked is not None else _boxed(text) or text)


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` (braces matched), None without one."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position]
    return None  # never closed: no boxed answer


def _last_number(text: str) -> Decimal | None:
    numbers = _NUMBER.findall(text)
    return _decimal(numbers[-1].replace(",", "")) if numbers else None


def _decimal(text: str) -> Decimal | None:
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None
