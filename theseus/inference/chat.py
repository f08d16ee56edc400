"""Chat generation: each conversation rendered by the model's chat template with the generation
prompt (as transformers' ``apply_chat_template(..., add_generation_prompt=True)``), its reply
generated (:func:`theseus.inference.generate`) and cut at the first end-of-sequence id of the
tokenizer folder, the ids transformers' ``generate`` stops on
(:attr:`~theseus.tokenization.folder.TokenizerFolder.eos_ids`: the generation config's, which
list the end-of-turn token, else the tokenizer's ``eos_token``). Decoding ends once every reply
has its stop token (or at ``max_new_tokens``); the reply is what comes before its first one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from theseus.config import read_yaml
from theseus.inference.generate import generate
from theseus.tokenization.chat.records import Conversation, parse_record
from theseus.tokenization.folder import TokenizerFolder


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
    template = folder.chat_template()
    if template is None:
        raise ValueError(
            f"tokenizer folder {folder.path} has no chat template (neither chat_template.jinja nor a "
            "chat_template in tokenizer_config.json); pass a folder with one (--tokenizer)"
        )
    if isinstance(conversations, dict) or not conversations:
        raise ValueError("give one or more conversations, each a list of {role, content} messages")
    prompts = []
    for number, messages in enumerate(conversations):
        record = parse_record({"messages": messages}, number, f"conversation {number}")
        assert isinstance(record, Conversation)
        text = template.render(record.messages, add_generation_prompt=True)
        prompts.append(folder.tokenizer.encode(text, add_special_tokens=False).ids)
    stops = folder.eos_ids
    result = generate(
        run_dir,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        tokenizer=folder.tokenizer_file,
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
        text = folder.tokenizer.decode(kept, skip_special_tokens=False)
        taken = ids if end is None else ids[: end + 1]
        replies.append(
            ChatReply(list(messages), text, completion.prompt_ids, taken, end is not None)
        )
    return ChatGeneration(
        replies,
        result.checkpoint_step,
        result.tokens_per_s,
        result.policy,
        str(folder.path),
        sorted(stops),
        result.new_tokens,
        result.notes,
    )


def chat_folder(run_dir: Path, tokenizer: str | Path | None) -> TokenizerFolder:
    """The tokenizer folder of a chat: ``tokenizer`` (a folder or its tokenizer.json), else the
    run's folder, else the folder of its ``data.path`` (a tokenized chat folder)."""
    config = run_dir / "config.yaml"
    data = (read_yaml(config, "run config") or {}).get("data") if config.is_file() else None
    data_path = data.get("path") if isinstance(data, dict) else None
    folder = TokenizerFolder.find(tokenizer, [run_dir, data_path])
    if folder is None:
        raise ValueError(
            f"chat generation needs the model's tokenizer folder (tokenizer.json and "
            f"tokenizer_config.json with its chat template), but "
            f"{' and '.join(str(c) for c in [run_dir, data_path] if c)} hold none; pass it with "
            "--tokenizer FOLDER"
        )
    return folder
