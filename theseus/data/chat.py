"""Chat records to token ids and loss masks, as transformers makes them.

A conversation is rendered by its model's chat template (:mod:`theseus.data.chat_template`) and
encoded with the ``tokenizers`` library without adding special tokens (what
``apply_chat_template(messages, tokenize=True)`` does: the template writes them). A token trains
when its characters overlap a trained span, the rule of transformers' ``assistant_masks``. A plain
prompt and completion are encoded as the tokenizer encodes a text (its own special tokens, e.g.
Llama's begin-of-text) followed by the end-of-text token; the completion's tokens and the
end-of-text token train.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from theseus.data.bpe import end_of_text, load_tokenizer
from theseus.data.chat_records import Conversation, Record, TextCompletion
from theseus.data.chat_template import ChatTemplate, Span, load_chat_template
from theseus.data.shards import TOKENIZER_FILE


@dataclass(frozen=True)
class Example:
    """A record rendered: its text, trained character spans, and how it is encoded."""

    document: int
    text: str
    spans: tuple[Span, ...]
    plain: bool  # a plain prompt/completion: the tokenizer's special tokens, then end-of-text
    where: str


@dataclass(frozen=True)
class Encoded:
    """One example's token ids and loss mask (1 where the token trains)."""

    ids: np.ndarray  # (tokens,) int64
    mask: np.ndarray  # (tokens,) uint8


@dataclass(frozen=True)
class ChatEncoder:
    """A model's tokenizer and chat template (None when its folder has none)."""

    tokenizer: object  # tokenizers.Tokenizer
    template: ChatTemplate | None
    eos_token: str
    eos_id: int
    folder: Path

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        chat_template: str | os.PathLike | None = None,
        eos_token: str | None = None,
    ) -> ChatEncoder:
        """The tokenizer of a model's tokenizer folder (``tokenizer.json`` and
        ``tokenizer_config.json``), with its chat template or ``chat_template`` (a Jinja file);
        the end-of-text token is ``eos_token``, else the configuration's, else a usual one."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(
                f"chat records need the model's tokenizer folder (tokenizer.json and "
                f"tokenizer_config.json), but --tokenizer {folder} is not a folder; pass the folder"
            )
        tokenizer = load_tokenizer(folder / TOKENIZER_FILE)
        template = load_chat_template(
            folder, None if chat_template is None else Path(chat_template)
        )
        name = eos_token or (template.special_tokens.get("eos_token") if template else None)
        name, eos_id = end_of_text(tokenizer, name, f"tokenizer {folder}")
        return cls(tokenizer, template, name, eos_id, folder)

    def render(self, record: Record) -> Example:
        """A record as text and trained spans (the template runs here)."""
        if isinstance(record, TextCompletion):
            text = record.prompt + record.completion
            return Example(
                record.document, text, ((len(record.prompt), len(text)),), True, record.where
            )
        assert isinstance(record, Conversation)
        if self.template is None:
            raise ValueError(
                f"{record.where} is a conversation, but tokenizer folder {self.folder} has no chat "
                "template (neither chat_template.jinja nor a chat_template in "
                "tokenizer_config.json); pass the template with --chat-template FILE"
            )
        try:
            rendered = self.template.render_trained(
                record.messages, tools=record.tools, first=record.first
            )
        except ValueError as error:
            raise ValueError(f"{record.where}: {error}") from None
        return Example(record.document, rendered.text, rendered.spans, False, record.where)

    def encode(self, examples: list[Example]) -> list[Encoded]:
        """Token ids and masks of rendered examples, encoded in batches (the library spreads a
        batch over every core)."""
        results: list[Encoded | None] = [None] * len(examples)
        for plain in (False, True):
            chosen = [i for i, example in enumerate(examples) if example.plain == plain]
            if not chosen:
                continue
            texts = [examples[i].text for i in chosen]
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=plain)
            for i, encoding in zip(chosen, encodings, strict=True):
                results[i] = self._encoded(examples[i], encoding)
        return results

    def encode_record(self, record: Record) -> Encoded:
        """One record's ids and mask."""
        return self.encode([self.render(record)])[0]

    def _encoded(self, example: Example, encoding) -> Encoded:
        ids = np.asarray(encoding.ids, dtype=np.int64)  # (tokens,)
        pairs = itertools.chain.from_iterable(encoding.offsets)  # twice as fast as asarray
        offsets = np.fromiter(pairs, np.int64, count=2 * ids.size).reshape(-1, 2)  # (tokens, 2)
        mask = trained_tokens(offsets, example.spans)
        if example.plain and (not ids.size or ids[-1] != self.eos_id):
            ids = np.append(ids, self.eos_id)
            mask = np.append(mask, np.uint8(1))
        if not mask.any():
            raise ValueError(
                f"{example.where}: the record has no token to train (no assistant turn, or only "
                "empty ones, after the template ran); give it an assistant reply or a completion"
            )
        return Encoded(ids, mask)


def trained_tokens(offsets: np.ndarray, spans: tuple[Span, ...]) -> np.ndarray:
    """1 for each token (character ``offsets``, ``(tokens, 2)``) that overlaps a span: its end
    is past the start of the first span that ends after the token's start (transformers'
    ``assistant_masks`` rule; spans are in order)."""
    if not spans:
        return np.zeros(len(offsets), np.uint8)
    bounds = np.asarray(spans, dtype=np.int64)  # (spans, 2)
    index = np.searchsorted(bounds[:, 1], offsets[:, 0], side="right")  # (tokens,)
    inside = index < len(bounds)
    starts = bounds[np.minimum(index, len(bounds) - 1), 0]  # (tokens,)
    return (inside & (offsets[:, 1] > starts)).astype(np.uint8)
