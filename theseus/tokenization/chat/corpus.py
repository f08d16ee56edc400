"""``theseus tokenize`` of a chat corpus: conversations rendered with the model's chat template,
encoded with its tokenizer, written as token shards with a loss mask beside each (the format of
:mod:`theseus.data.shards`, ``"loss_mask": true`` in the manifest).

Records stream with bounded memory: this process reads them in batches of about
``BATCH_BYTES``, worker processes (one per core, for corpora of several batches) decode, render,
encode and mask each batch (:mod:`theseus.tokenization.chat.batches`), and this process writes them in
order. Each record is one document, split by document as text corpora are; an interrupted run
resumes from its progress record and writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, Unpack

import numpy as np

from theseus.config import check_int
from theseus.data.packing import Packing, pack
from theseus.data.readers import InputFile, fingerprint, list_inputs, walk_sorted
from theseus.data.shards import (
    DOCS_DTYPE,
    MASK_DTYPE,
    SPLITS,
    TOKENIZED_RECORD,
    Manifest,
    ShardWriter,
    example_lengths,
    read_json,
)
from theseus.data.split import DocumentSplit
from theseus.tokenization.chat.batches import (
    Encode,
    EncodedBatch,
    EncoderSource,
    RawRecord,
    default_workers,
    encode_batch,
    encoded_batches,
)
from theseus.tokenization.chat.encoder import ChatEncoder
from theseus.tokenization.chat.records import (
    chat_files,
    first_record,
    is_chat_record,
    raw_records,
)
from theseus.tokenization.folder import CHAT_TEMPLATE_FILE
from theseus.tokenization.inputs import BUILTIN
from theseus.tokenization.output import Output, settings, sha256
from theseus.tokenization.streaming import by_text_bytes
from theseus.tokenization.text import DEFAULT_SHARD_TOKENS, TokenizedCorpus, token_dtype


@dataclass(frozen=True)
class ChatTokenized:
    """What tokenizing a chat corpus wrote: the corpus figures and the trained tokens."""

    corpus: TokenizedCorpus
    train_trained_tokens: int
    validation_trained_tokens: int
    longest_example: int  # tokens of the longest conversation, train or validation
    packing: Packing | None  # the train split packed into rows of seq_len + 1 (None: no seq_len)

    def describe(self) -> str:
        c = self.corpus
        head = (
            c.masked(
                f"{c.train_documents:,} + {c.validation_documents:,} conversations rendered with the "
                "chat template",
                f"{self.train_trained_tokens:,} + {self.validation_trained_tokens:,} train",
            )
            + f"; the longest conversation has {self.longest_example:,} tokens"
        )
        if self.packing is None:
            return head + (
                " (training packs conversations into rows of training.seq_len + 1 tokens; "
                "--seq-len shows the packing here, run.json reports it)"
            )
        p = self.packing
        return head + (
            f"; packed as training packs them into rows of {p.row_tokens:,} tokens "
            f"(training.seq_len + 1), the train split fills {p.num_rows:,} rows "
            f"{p.efficiency:.1%} with tokens that are not padding ({p.truncated:,} longer "
            "conversations cut here; data.overlong decides in training)"
        )


def is_chat_corpus(corpus: str | os.PathLike) -> bool:
    """Whether ``corpus`` is a chat corpus: the first record of its first JSON Lines or Parquet
    file holds ``messages``, or ``prompt`` and ``completion``."""
    return is_chat_record(first_corpus_record(corpus))


def first_corpus_record(corpus: str | os.PathLike) -> object | None:
    """The first record of the first JSON Lines or Parquet file of ``corpus`` (None when it
    has none, or is not a readable one: the text corpus reader reports it)."""
    path = Path(corpus)
    if str(corpus) == BUILTIN or not path.exists() or path.suffix == ".bin":
        return None
    if path.is_file():
        inputs = list_inputs(path.parent, [path.name])
    else:
        inputs = list_inputs(path, walk_sorted(path))
    try:
        return first_record([f for f in inputs if f.kind != "text"])
    except ValueError:
        return None


class RecordsOptions(TypedDict, total=False):
    """The optional keywords of :func:`tokenize_chat` and
    :func:`~theseus.tokenization.chat.preference.tokenize_preference`, with :class:`Settings`'
    meanings and defaults."""

    chat_template: str | os.PathLike | None
    eos_token: str | None
    validation_fraction: float
    seed: int
    shard_tokens: int
    overwrite: bool
    seq_len: int | None
    workers: int | None


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How records become a masked corpus: the model's tokenizer folder, its chat template (the
    folder's, or the Jinja file ``chat_template``) and end-of-text token (None: the folder's),
    the split and the shard size; ``overwrite`` an existing corpus; ``seq_len``, the training
    sequence length the result reports for (None: none); ``workers`` processes that render and
    encode (1: this process; None: one per core for corpora of several batches)."""

    tokenizer: str | os.PathLike
    chat_template: str | os.PathLike | None = None
    eos_token: str | None = None
    validation_fraction: float = 0.1
    seed: int = 0
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    overwrite: bool = False
    seq_len: int | None = None
    workers: int | None = 1

    def __post_init__(self) -> None:
        if self.seq_len is not None:
            check_int("seq_len", self.seq_len, minimum=1)
        if self.workers is not None:
            check_int("workers", self.workers, minimum=1)
        check_int("shard_tokens", self.shard_tokens, minimum=1)


def tokenize_chat(
    corpus: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike,
    **options: Unpack[RecordsOptions],
) -> ChatTokenized:
    """Tokenize the chat records of ``corpus`` with the tokenizer folder ``tokenizer`` (its chat
    template, or the Jinja file ``chat_template``) into token and mask shards in ``out_dir``;
    running it again on an interrupted folder goes on from its complete shards. With
    ``seq_len``, the result also packs the train split as a run of that ``training.seq_len``
    would (longer conversations truncated), for its packing efficiency. The other ``options``
    as :class:`Settings`; ``theseus tokenize`` asks for ``workers=None``. Worker processes
    start by importing the main module, so a script that asks for them calls this under
    ``if __name__ == "__main__":``."""
    given = Settings(tokenizer=tokenizer, **options)

    def finish(job: RecordsJob, records: int) -> tuple[dict, dict]:
        return job.finish(f"chat records {str(corpus)!r}, {len(job.files)} file(s)")

    return _result(
        *run_records_job(corpus, out_dir, given, {}, encode_batch, finish), given.seq_len
    )


def run_records_job(
    corpus: str | os.PathLike,
    out_dir: str | os.PathLike,
    given: Settings,
    own: dict,
    encode: Encode,
    finish: Callable[[RecordsJob, int], tuple[dict, dict]],
) -> tuple[TokenizedCorpus, dict]:
    """Tokenize records (chat or preference, as ``encode`` encodes them) into ``out_dir`` unless
    an earlier run finished it, ``finish(job, records read)`` writing the manifest: the corpus
    figures (timed from here) and the manifest's record."""
    start = time.perf_counter()
    job = RecordsJob.open(corpus, out_dir, given, own, encode)
    if job.output.finished is not None:
        manifest = read_json(job.output.out / TOKENIZED_RECORD, "manifest")
        fields = job.output.finished
    else:
        manifest, fields = finish(job, job.write(given.workers, encode))
    return TokenizedCorpus(**fields, seconds=time.perf_counter() - start), manifest


@dataclass(frozen=True)
class RecordsJob:
    """Records (chat or preference) being tokenized into a masked corpus: the files, the
    encoder (and what worker processes build theirs from), the output folder and its settings."""

    corpus: str | os.PathLike
    files: list[InputFile]
    source: EncoderSource
    encoder: ChatEncoder
    output: Output
    settings: Settings
    own: dict

    @classmethod
    def open(
        cls,
        corpus: str | os.PathLike,
        out_dir: str | os.PathLike,
        given: Settings,
        own: dict,
        encode: Encode,
    ) -> RecordsJob:
        """The job's files and encoder, its output folder prepared (fresh, resumed or
        finished), after ``encode`` ran on each file's first record (a bad one, or a missing
        template, stops it before anything is written); ``own`` joins the settings."""
        files = chat_files(corpus)
        template = None if given.chat_template is None else str(given.chat_template)
        source = EncoderSource(str(given.tokenizer), template, given.eos_token)
        encoder = source.encoder()
        for item in files:
            for raw, document, where in raw_records([item]):
                encode(encoder, [("train", raw, document, where)])
                break
        sha = None if encoder.template is None else encoder.template.sha256
        own = {"chat_template": sha, "eos_token": encoder.eos_token, "loss_mask": True, **own}
        tokenizer_id = sha256(encoder.tokenizer.to_str())
        chosen = settings(
            fingerprint(files),
            tokenizer_id,
            own,
            given.validation_fraction,
            given.seed,
            given.shard_tokens,
        )
        output = Output.prepare(out_dir, chosen, overwrite=given.overwrite)
        return cls(corpus, files, source, encoder, output, given, own)

    @property
    def token_dtype(self) -> str:
        return token_dtype(self.encoder.tokenizer.get_vocab_size())

    def write(self, workers: int | None, encode: Encode) -> int:
        """Encode every record with ``encode`` (in ``workers`` processes) and write the
        shards, going on from an interrupted run's; the number of records read."""
        output, split = (
            self.output,
            DocumentSplit(self.settings.validation_fraction, self.settings.seed),
        )
        dtypes = {"bin": self.token_dtype, "mask": MASK_DTYPE, "docs": DOCS_DTYPE}
        read = {"records": 0}
        with output.writing():
            _copy_tokenizer(self.encoder, output.out)
            with output.shards(self.settings.shard_tokens, dtypes, self.corpus) as writers:
                batches = _raw_batches(self.files, split, output.resume, read)
                workers = default_workers(self.files) if workers is None else workers
                for batch in encoded_batches(self.source, self.encoder, batches, workers, encode):
                    for name, writer in writers.items():
                        chosen = [k for k, s in enumerate(batch.splits) if s == name]

                        def on_close(index: int, name=name, chosen=chosen, batch=batch) -> None:
                            output.shard_closed(name, (batch.documents[chosen[index]] + 1, 0))

                        if chosen:
                            _write(writer, batch, chosen, on_close)
        return read["records"]

    def finish(self, description: str, **fields) -> tuple[dict, dict]:
        """Write the manifest: the tokenizer's facts, the template's hash and ``fields``."""
        encoder = self.encoder
        return self.output.finish(
            description,
            vocab_size=encoder.tokenizer.get_vocab_size(),
            token_dtype=self.token_dtype,
            eos_token=encoder.eos_token,
            eos_id=encoder.eos_id,
            tokenizer_sha256=self.output.settings["tokenizer"],
            trained_tokenizer=False,
            loss_mask=True,
            chat_template_sha256=self.own["chat_template"],
            **fields,
        )


def _raw_batches(
    files: list[InputFile], split: DocumentSplit, resume: dict, read: dict
) -> Iterator[list[RawRecord]]:
    """Records as read, routed to their split, in batches of about ``BATCH_BYTES``; records
    before their split's resume position are skipped (``read["records"]`` counts them all)."""

    def routed() -> Iterator[RawRecord]:
        for raw, document, where in raw_records(files):
            read["records"] = document + 1
            yield "validation" if split.is_validation(document) else "train", raw, document, where

    kept = (record for record in routed() if (record[2], 0) >= resume[record[0]])
    return by_text_bytes(kept, lambda record: _as_read(record[1]))


def _as_read(raw: object) -> bytes | str:
    """A record as read, for its size: a JSON line's bytes, a Parquet row as JSON."""
    return raw if isinstance(raw, bytes) else json.dumps(raw, default=str)


def _write(writer: ShardWriter, batch: EncodedBatch, chosen: list[int], on_close):
    """Append the examples ``chosen`` (those of the writer's split) of a batch."""
    tokens = np.repeat(np.asarray(batch.splits) == writer.split, batch.counts)  # (batch tokens,)
    counts = batch.counts[chosen]  # (chosen,)
    arrays = {
        "bin": batch.ids[tokens].astype(writer.dtypes["bin"]),
        "mask": batch.mask[tokens],
        "docs": counts,
    }
    sizes = [batch.sizes[k] for k in chosen]
    writer.write_pieces(arrays, counts.tolist(), sizes, [batch.lasts[k] for k in chosen], on_close)


def _copy_tokenizer(encoder: ChatEncoder, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the template used, beside the shards."""
    encoder.folder.copy_config(out)
    if encoder.template is not None:
        (out / CHAT_TEMPLATE_FILE).write_text(encoder.template.source)


def _result(corpus: TokenizedCorpus, record: dict, seq_len: int | None) -> ChatTokenized:
    train, validation = (record["splits"][name]["trained_tokens"] for name in SPLITS)
    folder, manifest = Path(corpus.out_dir), Manifest(record)
    lengths = {name: example_lengths(folder, manifest, name) for name in SPLITS}
    longest = max(int(split.max()) for split in lengths.values())
    packing = None
    if seq_len is not None:  # the seed orders examples in buffers: efficiency barely depends on it
        packing = pack(lengths["train"], seq_len + 1, 0, "truncate", f"chat corpus {folder}")
    return ChatTokenized(corpus, train, validation, longest, packing)
