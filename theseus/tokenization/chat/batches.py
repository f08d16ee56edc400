"""Chat records to token ids and loss masks, a batch at a time, in this process or in worker
processes.

A batch is about ``BATCH_BYTES`` of records as read (JSON lines, Parquet rows), routed to their
split. Encoding it — decoding the JSON, rendering the template, the ``tokenizers`` library's
encoding and the masks — is :func:`encode_batch`. With more than one worker, batches go to that
many processes, each encoding one batch at a time on one core (the library's own threads off),
and come back in order: the JSON and Jinja work then spreads over the cores instead of holding
one interpreter's GIL beside the library's threads (measured in ``docs/performance.md``).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from theseus.data.readers import InputFile
from theseus.tokenization import streaming
from theseus.tokenization.chat.encoder import ChatEncoder, utf8_size
from theseus.tokenization.chat.records import parse_raw

RawRecord = tuple[str, object, int, str]  # (split, record as read, document, where)


@dataclass(frozen=True)
class EncoderSource:
    """What a worker process builds its :class:`ChatEncoder` from."""

    folder: str
    chat_template: str | None
    eos_token: str | None

    def encoder(self) -> ChatEncoder:
        return ChatEncoder.from_folder(self.folder, self.chat_template, self.eos_token)


@dataclass(frozen=True)
class EncodedBatch:
    """A batch's records encoded as examples, in reading order: a chat record is one example,
    a preference pair two (chosen, then rejected), which end their record (``lasts``)."""

    splits: list[str]  # each example's split (its record's)
    documents: list[int]  # each example's record number
    ids: np.ndarray  # (tokens,) int32, the examples' ids one after another
    mask: np.ndarray  # (tokens,) uint8, 1 where the token trains
    counts: np.ndarray  # (examples,) tokens of each example
    sizes: list[int]  # UTF-8 bytes of each rendered example
    lasts: list[bool]  # whether each example is its record's last


Encode = Callable[[ChatEncoder, list[RawRecord]], EncodedBatch]  # a top-level function (pickled)


def encode_batch(encoder: ChatEncoder, records: list[RawRecord]) -> EncodedBatch:
    """Decode, render, encode and mask one batch."""
    examples = [
        encoder.render(parse_raw(raw, document, where)) for _, raw, document, where in records
    ]
    encoded = encoder.encode(examples)
    return EncodedBatch(
        [split for split, *_ in records],
        [document for _, _, document, _ in records],
        np.concatenate([e.ids for e in encoded]),
        np.concatenate([e.mask for e in encoded]),
        np.asarray([e.ids.size for e in encoded], np.int64),
        [utf8_size(example.text) for example in examples],
        [True] * len(examples),
    )


def encoded_batches(
    source: EncoderSource,
    encoder: ChatEncoder,
    batches: Iterator[list[RawRecord]],
    workers: int,
    encode: Encode = encode_batch,
) -> Iterator[EncodedBatch]:
    """Each batch encoded by ``encode``, in order: here when ``workers`` is 1, else by that
    many processes with at most two batches each in flight (memory stays bounded)."""
    if workers == 1:
        for batch in batches:
            yield encode(encoder, batch)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that may run JAX
    pool = ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(source,))
    pending: collections.deque = collections.deque()
    try:
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, encode, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def default_workers(files: list[InputFile]) -> int:
    """One process per available core, but no more than the corpus has batches of about
    ``BATCH_BYTES`` to share (1: encode here, without starting processes)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    size = sum(item.path.stat().st_size for item in files)
    return max(1, min(cores or 1, size // streaming.BATCH_BYTES))


_worker_encoder: ChatEncoder | None = None


def _start_worker(source: EncoderSource) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; the workers share them
    _worker_encoder = source.encoder()


def _encode_in_worker(encode: Encode, records: list[RawRecord]) -> EncodedBatch:
    assert _worker_encoder is not None, "the worker was not started"
    return encode(_worker_encoder, records)
