"""Streamed encoding of a corpus into token shards with bounded memory.

A reader thread reads pieces of documents (JSON parsing and decompression hold the GIL) and hands
batches of about ``BATCH_BYTES`` of text through a queue of ``QUEUE_BATCHES``; an encoder thread
encodes each batch with the ``tokenizers`` library's batch API (which releases the GIL and uses
every core) and hands it on (one batch ahead); the calling thread appends each split's tokens to
its current shard, so converting and writing one batch overlaps encoding the next. Memory holds
a few batches, never the corpus. Each document's last piece ends with the end-of-text token.

After every complete shard the progress record says, per split, its complete shards and the
piece it goes on from; a resumed run reads the corpus again from the start but encodes only the
pieces after each split's position, and so writes the same shards as an uninterrupted run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from theseus.data.readers import Piece
from theseus.data.shards import ShardWriter

if TYPE_CHECKING:  # the library loads with the first tokenizer, not with this module
    from tokenizers import Encoding

BATCH_BYTES = 4 * 2**20  # text per encode_batch call
QUEUE_BATCHES = 2  # batches read ahead of the encoder

Position = tuple[int, int]  # (document, piece within the document)
T = TypeVar("T")


@dataclass(frozen=True)
class Routed:
    """A piece and the split it belongs to."""

    piece: Piece
    split: str


def next_position(piece: Piece) -> Position:
    """Where a split goes on after ``piece``."""
    return (piece.document + 1, 0) if piece.last else (piece.document, piece.index + 1)


def batches(
    pieces: Iterator[Piece], split_of: Callable[[int], str], resume: dict[str, Position]
) -> Iterator[list[Routed]]:
    """Pieces routed to their split, in batches of about ``BATCH_BYTES``; pieces before their
    split's ``resume`` position (already in complete shards) are skipped."""
    routed = (Routed(piece, split_of(piece.document)) for piece in pieces)
    kept = (r for r in routed if r.piece.position >= resume[r.split])
    return by_text_bytes(kept, lambda r: r.piece.text)


def by_text_bytes(items: Iterator[T], text_of: Callable[[T], str | bytes]) -> Iterator[list[T]]:
    """``items`` in batches of about ``BATCH_BYTES`` of text (the last one may be smaller)."""
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(text_of(item))
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_stream(
    batches_in: Iterator[list[Routed]],
    tokenizer,
    *,
    eos_id: int,
    writers: dict[str, ShardWriter],
    on_shard: Callable[[str, Position], None],
    advance: Callable[[int], None],
) -> None:
    """Encode every batch and append its tokens to the writers; calls ``on_shard(split,
    position)`` after a shard of ``split`` is complete. Three stages overlap: a thread reads
    batches, a thread encodes them (the library releases the GIL), and this thread writes."""

    def encoded(batches: Iterator[list[Routed]]) -> Iterator[tuple[list[Routed], list]]:
        for batch in batches:
            texts = [routed.piece.text for routed in batch]
            yield batch, tokenizer.encode_batch_fast(texts, add_special_tokens=False)

    for batch, encodings in read_ahead(encoded(read_ahead(batches_in)), depth=1):
        for split, writer in writers.items():
            pieces = [
                (r.piece, e) for r, e in zip(batch, encodings, strict=True) if r.split == split
            ]
            if pieces:
                advance(_write_pieces(writer, pieces, eos_id, partial(on_shard, split)))


def _write_pieces(
    writer: ShardWriter,
    pieces: list[tuple[Piece, Encoding]],
    eos_id: int,
    on_shard: Callable[[Position], None],
) -> int:
    """Append encoded pieces of one split (converted to the shard dtype at once); calls
    ``on_shard(position)`` when a shard closes. Returns the bytes of text written."""
    ids: list[int] = []
    counts, sizes, lasts = [], [], []
    for piece, encoding in pieces:
        piece_ids = encoding.ids
        ids += piece_ids
        if piece.last:
            ids.append(eos_id)
        counts.append(len(piece_ids) + piece.last)
        sizes.append(len(piece.text) if piece.text.isascii() else len(piece.text.encode()))
        lasts.append(piece.last)
    tokens = np.asarray(ids, dtype=writer.dtypes["bin"])  # (tokens of these pieces,)
    writer.write_pieces(
        {"bin": tokens}, counts, sizes, lasts, lambda i: on_shard(next_position(pieces[i][0]))
    )
    return sum(sizes)


def read_ahead(items: Iterator[T], *, depth: int = QUEUE_BATCHES) -> Iterator[T]:
    """``items``, produced by a daemon thread at most ``depth`` ahead; an error there is
    raised here, and leaving early stops the thread."""
    channel: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item: object) -> bool:
        """Hand ``item`` over unless the consumer has left; False when it has."""
        while not stop.is_set():
            try:
                channel.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(done)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            put(error)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # a generator's own read-ahead stops its thread too

    thread = threading.Thread(target=produce, name="theseus-tokenize-reader", daemon=True)
    thread.start()
    try:
        while (item := channel.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)
