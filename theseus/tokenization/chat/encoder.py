"""Chat records to token ids and loss masks, as transformers makes them.

A conversation is rendered by its model's chat template (:mod:`theseus.tokenization.chat.template`) and
encoded with the ``tokenizers`` library without adding special tokens (what
``apply_chat_template(messages, tokenize=True)`` does: the template writes them). A token trains
when its characters overlap a trained span, the rule of transformers' ``assistant_masks``; for
byte-level tokenizers the overlap is found from the bytes each token id spells
(:class:`ByteSpelling`), the same tokens without the library's per-token offsets. A plain
prompt and completion are encoded as the tokenizer encodes a text (its own special tokens, e.g.
Llama's begin-of-text) followed by the end-of-text token; the completion's tokens and the
end-of-text token train.
"""

from __future__ import annotations

import itertools
import json
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from theseus.tokenization.chat.records import Conversation, Record, TextCompletion
from theseus.tokenization.chat.template import ChatTemplate, Span
from theseus.tokenization.folder import TokenizerFolder


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

    ids: np.ndarray  # (tokens,) int32
    mask: np.ndarray  # (tokens,) uint8


@dataclass(frozen=True)
class ByteSpelling:
    """How many bytes of the text each token id spells, for a tokenizer whose tokens spell the
    text exactly: byte-level BPE with no normalizer (or NFC, on texts NFC leaves alone), no
    pre-tokenizer that removes characters, no offsets trimmed and no added token that strips
    whitespace. A token's byte range then follows from the ids before it, and overlapping a span
    in bytes is overlapping it in characters (a token's characters are those holding its bytes),
    so the library need not build every token's offsets (converting them to Python cost more
    than half the Python time of encoding; bench/chat_bench.py)."""

    lengths: np.ndarray  # (vocab,) int64, -1 for ids the tokenizer does not define
    nfc: bool  # the normalizer is NFC: a text it would change takes the library's offsets

    @classmethod
    def of(cls, tokenizer) -> ByteSpelling | None:
        """The spelling of ``tokenizer`` (a ``tokenizers.Tokenizer``), None unless it qualifies."""
        spec = json.loads(tokenizer.to_str())
        normalizer = spec.get("normalizer")
        if normalizer is not None and normalizer.get("type") != "NFC":
            return None
        if not (_spelled_in_bytes(spec.get("pre_tokenizer")) and spec["model"]["type"] == "BPE"):
            return None
        if not _untrimmed(spec.get("post_processor")):
            return None
        alphabet = set(ByteLevel.alphabet())
        lengths = np.full(tokenizer.get_vocab_size(with_added_tokens=True), -1, np.int64)
        for token, index in spec["model"]["vocab"].items():
            if not alphabet.issuperset(token) or index >= lengths.size:
                return None
            lengths[index] = len(token)  # one alphabet character per byte
        for added in spec.get("added_tokens", []):
            if added["lstrip"] or added["rstrip"] or added["id"] >= lengths.size:
                return None
            lengths[added["id"]] = len(added["content"].encode())
        return cls(lengths, normalizer is not None)

    def spells(self, text: str) -> bool:
        """Whether the normalizer leaves ``text`` alone (its tokens then spell its bytes)."""
        return not self.nfc or unicodedata.is_normalized("NFC", text)


def _spelled_in_bytes(pre_tokenizer: dict | None) -> bool:
    """A byte-level pre-tokenizer (without an added prefix space), alone or after splitters
    that keep every character."""
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer])
    byte_level = [s for s in steps if s["type"] == "ByteLevel"]
    kept = {"ByteLevel", "Split", "Digits", "Punctuation"}
    return (
        len(byte_level) == 1
        and not byte_level[0]["add_prefix_space"]
        and all(s["type"] in kept and s.get("behavior") != "Removed" for s in steps)
    )


def _untrimmed(post_processor: dict | None) -> bool:
    """True when post-processing leaves token offsets as encoded (no ByteLevel trimming)."""
    if post_processor is None:
        return True
    steps = post_processor.get("processors", [post_processor])
    return all(
        s["type"] in {"TemplateProcessing", "ByteLevel"} and not s.get("trim_offsets", False)
        for s in steps
    )


@dataclass(frozen=True)
class ChatEncoder:
    """A model's tokenizer and chat template (None when its folder has none)."""

    tokenizer: Tokenizer
    template: ChatTemplate | None
    eos_token: str
    eos_id: int
    folder: TokenizerFolder
    spelling: ByteSpelling | None

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        chat_template: str | os.PathLike | None = None,
        eos_token: str | None = None,
    ) -> ChatEncoder:
        """The tokenizer of a model's tokenizer folder (``tokenizer.json`` and
        ``tokenizer_config.json``), with its chat template or ``chat_template`` (a Jinja file);
        the end-of-text token is ``eos_token``, else the folder's
        (:meth:`TokenizerFolder.eos_token`)."""
        if not Path(folder).is_dir():
            raise ValueError(
                f"chat records need the model's tokenizer folder (tokenizer.json and "
                f"tokenizer_config.json), but --tokenizer {folder} is not a folder; pass the folder"
            )
        tokenizer_folder = TokenizerFolder.at(folder)
        tokenizer = tokenizer_folder.tokenizer
        template = tokenizer_folder.chat_template(chat_template)
        name, eos_id = tokenizer_folder.eos_token(eos_token)
        return cls(tokenizer, template, name, eos_id, tokenizer_folder, ByteSpelling.of(tokenizer))

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
                f"{record.where} is a conversation, but tokenizer folder {self.folder.path} has no chat "
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
        """Token ids and masks of rendered examples."""
        return self._masked(examples, self._encodings(examples))

    def _encodings(self, examples: list[Example]) -> list:
        """The library's encodings of rendered examples, a batch per call (spread over the
        cores unless ``TOKENIZERS_PARALLELISM`` is off, as in tokenizing's worker processes).
        Conversations of a byte-level tokenizer are encoded without offsets
        (:class:`ByteSpelling`)."""
        results: list = [None] * len(examples)
        for plain in (False, True):
            chosen = [i for i, example in enumerate(examples) if example.plain == plain]
            if not chosen:
                continue
            texts = [examples[i].text for i in chosen]
            spelled = self.spelling is not None and not plain
            encode = self.tokenizer.encode_batch_fast if spelled else self.tokenizer.encode_batch
            for i, encoding in zip(chosen, encode(texts, add_special_tokens=plain), strict=True):
                results[i] = encoding
        return results

    def _masked(self, examples: list[Example], encodings: list) -> list[Encoded]:
        """Ids and loss masks from :meth:`_encodings`: a token trains when it overlaps a span,
        found from the bytes its id spells or else from the library's offsets. A batch is
        masked at once, its examples laid end to end on one line of positions (in bytes where
        the tokens spell the text, in characters otherwise)."""
        counts = np.fromiter(map(len, encodings), np.int64, len(encodings))  # (examples,)
        first = np.concatenate([[0], np.cumsum(counts)])  # (examples + 1,) first token of each
        pieces = itertools.chain.from_iterable(encoding.ids for encoding in encodings)
        ids = np.fromiter(pieces, np.int32, count=int(first[-1]))  # (tokens,)
        if self.spelling is None:
            before = np.zeros(ids.size + 1, np.int64)  # (tokens + 1,)
            spelled = [False] * len(examples)
            sizes = [len(example.text) for example in examples]
        else:
            before = np.concatenate([[0], np.cumsum(self.spelling.lengths[ids])])  # bytes before
            sizes = (before[first[1:]] - before[first[:-1]]).tolist()  # (examples,) spelled bytes
            spelled = [
                not e.plain and size == utf8_size(e.text) and self.spelling.spells(e.text)
                for e, size in zip(examples, sizes, strict=True)
            ]
            sizes = [
                n if ok else len(e.text) for e, n, ok in zip(examples, sizes, spelled, strict=True)
            ]
        base = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (examples + 1,)
        starts, ends = before[:-1], before[1:]  # (tokens,) each
        if not all(spelled):  # examples with other units and offsets: placed at their base
            shift = np.repeat(base[:-1] - before[first[:-1]], counts)  # (tokens,)
            starts, ends = starts + shift, ends + shift
        bases = base.tolist()
        spans = []
        for k, example in enumerate(examples):
            if spelled[k]:
                example_spans = _byte_spans(example.text, example.spans)
            else:
                encoding = encodings[k]
                if not example.plain and self.spelling is not None:  # encoded without offsets
                    encoding = self.tokenizer.encode(example.text, add_special_tokens=False)
                offsets = _library_offsets(encoding) + base[k]  # (tokens of k, 2)
                starts[first[k] : first[k + 1]], ends[first[k] : first[k + 1]] = offsets.T
                example_spans = example.spans
            spans += [(a + bases[k], b + bases[k]) for a, b in example_spans]
        mask = trained_tokens(starts, ends, spans)  # (tokens,)
        return [
            self._encoded(example, ids[first[k] : first[k + 1]], mask[first[k] : first[k + 1]])
            for k, example in enumerate(examples)
        ]

    def encode_record(self, record: Record) -> Encoded:
        """One record's ids and mask."""
        return self.encode([self.render(record)])[0]

    def _encoded(self, example: Example, ids: np.ndarray, mask: np.ndarray) -> Encoded:
        if example.plain and (not ids.size or ids[-1] != self.eos_id):
            ids = np.append(ids, self.eos_id)
            mask = np.append(mask, np.uint8(1))
        if not mask.any():
            raise ValueError(
                f"{example.where}: the record has no token to train (no assistant turn, or only "
                "empty ones, after the template ran); give it an assistant reply or a completion"
            )
        return Encoded(ids, mask)


def _library_offsets(encoding) -> np.ndarray:
    """The character offsets the library computed, ``(tokens, 2)``."""
    pairs = itertools.chain.from_iterable(encoding.offsets)  # twice as fast as asarray
    return np.fromiter(pairs, np.int64, count=2 * len(encoding)).reshape(-1, 2)


def utf8_size(text: str) -> int:
    """The length of ``text`` in UTF-8 bytes."""
    return len(text) if text.isascii() else len(text.encode())


def _byte_spans(text: str, spans: tuple[Span, ...]) -> tuple[Span, ...]:
    """Character spans of ``text`` as byte spans of its UTF-8 encoding."""
    if text.isascii():
        return spans
    return tuple((len(text[:a].encode()), len(text[:b].encode())) for a, b in spans)


def trained_tokens(starts: np.ndarray, ends: np.ndarray, spans: list[Span]) -> np.ndarray:
    """1 for each token (positions ``[starts, ends)``, each ``(tokens,)``) that overlaps a span:
    its end is past the start of the first span that ends after the token's start
    (transformers' ``assistant_masks`` rule; spans are in order)."""
    if not spans:
        return np.zeros(len(starts), np.uint8)
    bounds = np.asarray(spans, dtype=np.int64)  # (spans, 2)
    index = np.searchsorted(bounds[:, 1], starts, side="right")  # (tokens,)
    inside = index < len(bounds)
    span_starts = bounds[np.minimum(index, len(bounds) - 1), 0]  # (tokens,)
    return (inside & (ends > span_starts)).astype(np.uint8)
