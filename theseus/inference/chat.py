"""Chat generation: each conversation rendered by the model's chat template with the generation
prompt (as transformers' ``apply_chat_template(..., add_generation_prompt=True)``), its reply
generated (:func:`theseus.inference.generate`) and cut at the first stop token: the template's
end-of-turn token (the tokenizer configuration's ``eos_token``) or any end-of-sequence id of the
model's ``generation_config.json`` (Llama 3 lists several). Decoding ends once every reply
has its stop token (or at ``max_new_tokens``); the reply is what comes before its first one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from theseus.config import read_yaml
from theseus.data.chat import ChatEncoder
from theseus.data.chat_records import Conversation, parse_record
from theseus.data.shards import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from theseus.inference.generate import generate

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class ChatReply:
    """One conversation's reply: its text, the prompt's ids, the reply's ids (through the stop
    token) and whether a stop token ended it (else ``max_new_tokens`` did)."""

    messages: list[dict]
    reply: str
    prompt_ids: list[int]
    token_ids: list[int]
    stopped: bool


@dataclass(frozen=True)
class ChatGeneration:
    """What :func:`generate_chat` returns: the replies and how they were made."""

    replies: list[ChatReply]
    checkpoint_step: int
    tokens_per_s: float
    policy: str
    tokenizer_folder: str
    stop_ids: list[int]
    new_tokens: int  # tokens each row decoded before every reply had stopped
    notes: list[str] = field(default_factory=list)


def generate_chat(
    run_dir: str | Path,
    conversations: Sequence[Sequence[dict]],
    *,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    tokenizer: str | Path | None = None,
    policy_changes: dict[str, Any] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
) -> ChatGeneration:
    """Reply to each conversation (a list of ``{role, content}`` messages) with the newest good
    checkpoint of ``run_dir``. The chat template and tokenizer come from ``tokenizer`` (a
    tokenizer folder, or its ``tokenizer.json``), else the run's own folder (``import-hf`` and
    ``--init-from`` copy them), else the tokenized chat folder it trained on; the other
    arguments are :func:`theseus.inference.generate`'s."""
    folder = chat_folder(Path(run_dir), tokenizer)
    encoder = ChatEncoder.from_folder(folder)
    if encoder.template is None:
        raise ValueError(
            f"tokenizer folder {folder} has no chat template (neither chat_template.jinja nor a "
            "chat_template in tokenizer_config.json); pass a folder with one (--tokenizer)"
        )
    if isinstance(conversations, dict) or not conversations:
        raise ValueError("give one or more conversations, each a list of {role, content} messages")
    prompts = []
    for number, messages in enumerate(conversations):
        record = parse_record({"messages": messages}, number, f"conversation {number}")
        assert isinstance(record, Conversation)
        text = encoder.template.render(record.messages, add_generation_prompt=True)
        prompts.append(encoder.tokenizer.encode(text, add_special_tokens=False).ids)
    stops = stop_ids(encoder, folder)
    result = generate(
        run_dir,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        tokenizer=folder / TOKENIZER_FILE,
        policy_changes=policy_changes,
        job=job,
        base=base,
        stop_ids=stops,
    )
    replies = []
    for messages, completion in zip(conversations, result.completions, strict=True):
        ids = completion.token_ids
        end = next((i for i, token in enumerate(ids) if token in stops), None)
        kept = ids if end is None else ids[:end]
        text = encoder.tokenizer.decode(kept, skip_special_tokens=False)
        taken = ids if end is None else ids[: end + 1]
        replies.append(
            ChatReply(list(messages), text, completion.prompt_ids, taken, end is not None)
        )
    return ChatGeneration(
        replies,
        result.checkpoint_step,
        result.tokens_per_s,
        result.policy,
        str(folder),
        sorted(stops),
        result.new_tokens,
        result.notes,
    )


def chat_folder(run_dir: Path, tokenizer: str | Path | None) -> Path:
    """The tokenizer folder of a chat: ``tokenizer`` (a folder or its tokenizer.json), else the
    run's folder, else the folder of its ``data.path`` (a tokenized chat folder)."""
    if tokenizer is not None:
        given = Path(tokenizer)
        candidates = [given if given.is_dir() else given.parent]
    else:
        candidates = [run_dir]
        config = run_dir / "config.yaml"
        data = (read_yaml(config, "run config") or {}).get("data") if config.is_file() else None
        if isinstance(data, dict) and data.get("path"):
            candidates.append(Path(data["path"]))
    for folder in candidates:
        if (folder / TOKENIZER_FILE).is_file() and (folder / TOKENIZER_CONFIG_FILE).is_file():
            return folder
    raise ValueError(
        f"chat generation needs the model's tokenizer folder (tokenizer.json and "
        f"tokenizer_config.json with its chat template), but "
        f"{' and '.join(str(c) for c in candidates)} hold none; pass it with --tokenizer FOLDER"
    )


def stop_ids(encoder: ChatEncoder, folder: Path) -> frozenset[int]:
    """The end-of-turn id and every end-of-sequence id of the folder's generation config."""
    ids = {encoder.eos_id}
    path = folder / GENERATION_CONFIG
    if path.is_file():
        given = json.loads(path.read_text()).get("eos_token_id")
        ids |= set(given if isinstance(given, list) else [] if given is None else [given])
    return frozenset(int(i) for i in ids)
