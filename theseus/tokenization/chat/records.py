"""Chat and completion records: JSON Lines (plain, gzip or zstd) and Parquet rows holding
``messages`` (a list of ``{role, content}``, as OpenAI and Hugging Face write them, with optional
``tools``), or ``prompt`` and ``completion`` (two texts, or two lists of messages); preference
records (``chosen`` and ``rejected``) are read here too and parsed by :mod:`.pairs`.

Records are numbered in reading order (files sorted by relative path) like documents; a bad
record is a ``ValueError`` naming its file and line or row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from theseus.data.readers import (
    InputFile,
    errors_name,
    json_value,
    jsonl_lines,
    list_inputs,
    parquet_rows,
    walk_sorted,
)


@dataclass(frozen=True)
class Conversation:
    """Messages to render with the chat template; those before ``first`` (a prompt's) never
    train."""

    document: int
    messages: list[dict]
    tools: list | None
    first: int
    where: str


@dataclass(frozen=True)
class TextCompletion:
    """A plain prompt and its completion: the completion (and an end-of-text token) trains."""

    document: int
    prompt: str
    completion: str
    where: str


Record = Conversation | TextCompletion
# The fields of chat records and of preference records (theseus.tokenization.chat.pairs).
RECORD_FIELDS = ("messages", "prompt", "completion", "chosen", "rejected", "tools")


def is_chat_record(record: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(record, dict) and (
        "messages" in record or ("prompt" in record and "completion" in record)
    )


def chat_files(corpus: str | os.PathLike) -> list[InputFile]:
    """The JSON Lines and Parquet files of a chat corpus (a file or a folder)."""
    root = Path(corpus)
    if not root.exists():
        raise ValueError(
            f"corpus {str(root)!r} does not exist; pass a chat JSON Lines or Parquet file or a folder of them"
        )
    files = (
        list_inputs(root.parent, [root.name])
        if root.is_file()
        else list_inputs(root, walk_sorted(root))
    )
    if not files:
        raise ValueError(f"corpus {str(root)!r} holds no non-empty files; add records to it")
    for item in files:
        if item.kind == "text":
            raise ValueError(
                f"{item.path} is a text file in a chat corpus; chat records come in JSON Lines "
                "(.jsonl, .jsonl.gz, .jsonl.zst) or Parquet files: convert or remove it"
            )
    return files


def first_record(files: list[InputFile]) -> object | None:
    """The first raw record of the first file (None when it holds none)."""
    for raw, _, where in raw_records(files):
        return decoded(raw, where)
    return None


def read_records(files: list[InputFile]) -> Iterator[Record]:
    """Every record of ``files`` in order, checked."""
    for raw, document, where in raw_records(files):
        yield parse_raw(raw, document, where)


def raw_records(files: list[InputFile]) -> Iterator[tuple[object, int, str]]:
    """Every record of ``files`` in order as read, not yet decoded (a JSON line's bytes, a
    Parquet row's dict), with its number and where it is."""
    document = 0
    for item in files:
        with errors_name(item):
            for raw, where in _raw_records(item):
                yield raw, document, where
                document += 1


def parse_raw(raw: object, document: int, where: str) -> Record:
    """A record from :func:`raw_records`, decoded and checked."""
    return parse_record(decoded(raw, where), document, where)


def decoded(raw: object, where: str) -> object:
    return json_value(raw, where) if isinstance(raw, bytes) else raw


def parse_record(raw: object, document: int, where: str) -> Record:
    if not is_chat_record(raw):
        keys = ", ".join(map(repr, raw)) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(
            f"{where}: the record has no 'messages' field (nor 'prompt' and 'completion'; it "
            f"has {keys or 'nothing'}); give each record a list of {{role, content}} messages "
            "or a prompt and a completion"
        )
    tools = tools_of(raw, where)
    if "messages" in raw:
        return Conversation(
            document, checked_messages(raw["messages"], where, "messages"), tools, 0, where
        )
    prompt, completion = raw["prompt"], raw["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return TextCompletion(document, prompt, completion, where)
    if isinstance(prompt, list) and isinstance(completion, list):
        messages = checked_messages(prompt, where, "prompt") + checked_messages(
            completion, where, "completion"
        )
        return Conversation(document, messages, tools, len(prompt), where)
    raise ValueError(
        f"{where}: 'prompt' and 'completion' hold {type(prompt).__name__} and "
        f"{type(completion).__name__}; give two texts or two lists of messages"
    )


def tools_of(raw: dict, where: str) -> list | None:
    """A record's ``tools`` (None when it has none), checked."""
    tools = raw.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: 'tools' holds {type(tools).__name__}, not a list; fix it")
    return tools


def checked_messages(messages: object, where: str, field: str) -> list[dict]:
    """``messages`` (field ``field`` of the record at ``where``), checked: a non-empty list of
    messages with a role and a content."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: {field!r} holds {type(messages).__name__ if messages else 'nothing'}, not "
            "a non-empty list of messages; fix the record"
        )
    for number, message in enumerate(messages):
        lacking = (
            [key for key in ("role", "content") if key not in message]
            if isinstance(message, dict)
            else ["role", "content"]
        )
        if lacking:
            raise ValueError(
                f"{where}: message {number} of {field!r} lacks {' and '.join(map(repr, lacking))} "
                f"(it is {json.dumps(message)[:120]}); every message needs a role and a content "
                "(null only beside tool_calls)"
            )
        if not isinstance(message["role"], str):
            raise ValueError(f"{where}: message {number} has role {message['role']!r}, not text")
        if message["content"] is None and not message.get("tool_calls"):
            raise ValueError(
                f"{where}: message {number} of {field!r} has a null content and no tool_calls; "
                "give it a content"
            )
    return messages


def _raw_records(item: InputFile) -> Iterator[tuple[object, str]]:
    if item.kind == "parquet":
        import pyarrow.parquet as pq

        names = pq.ParquetFile(item.path).schema_arrow.names
        columns = [c for c in RECORD_FIELDS if c in names]
        if not columns:
            raise ValueError(
                f"{item.path} has no column 'messages' (nor 'prompt' and 'completion', nor "
                f"'chosen' and 'rejected'; its columns: {', '.join(names)}); give it the "
                "conversations or preference pairs"
            )
        yield from parquet_rows(item, columns=columns)
        return
    for line, number in jsonl_lines(item):
        yield line, f"{item.path}, line {number}"
