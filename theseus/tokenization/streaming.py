"""Streamed encoding of a corpus into token shards with bounded memory.

A reader thread reads pieces of documents (JSON parsing and decompression hold the GIL) and hands
batches of about ``BATCH_BYTES`` of text through a queue of ``QUEUE_BATCHES``; an encoder thread
encodes each batch with the ``tokenizers`` library's batch API (which releases the GIL and uses
every core) in calls of about ``ENCODE_BYTES``, turns each call's encodings into arrays of the
shard dtype at once and hands the batch's arrays on (one batch ahead); the calling thread appends
each split's tokens to its current shard, so writing one batch overlaps encoding the next.
Memory holds a few batches of text and of token arrays, and the library's encodings (about 100
bytes a token) of one call only, however far the writer lags: never the corpus; the C heap's
free pages go back to the system after each call. Each document's last piece ends with the
end-of-text token.

After every complete shard the progress record says, per split, its complete shards and the
piece it goes on from; a resumed run reads the corpus again from the start but encodes only the
pieces after each split's position, and so writes the same shards as an uninterrupted run.
"""

from __future__ import annotations

import ctypes
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

BATCH_BYTES = 4 * 2**20  # text per batch handed from the reader to the encoder
ENCODE_BYTES = 2**20  # text per encode_batch call: its encodings take about 100 bytes a token
ENCODE_MIN_PIECES = 4  # pieces per call at least (a text file's pieces of PIECE_BYTES, in parallel)
QUEUE_BATCHES = 2  # batches read ahead of the encoder

# glibc's malloc_trim, where the C library has one (see release_free_memory)
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)

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


def by_text_bytes(
    items: Iterator[T],
    text_of: Callable[[T], str | bytes],
    *,
    size: int | None = None,
    min_items: int = 1,
) -> Iterator[list[T]]:
    """``items`` in batches of about ``size`` (default ``BATCH_BYTES``) of text and at least
    ``min_items`` items (the last one may be smaller)."""
    limit = BATCH_BYTES if size is None else size
    batch: list[T] = []
    text_bytes = 0
    for item in items:
        batch.append(item)
        text_bytes += len(text_of(item))
        if text_bytes >= limit and len(batch) >= min_items:
            yield batch
            batch, text_bytes = [], 0
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

    dtype = next(iter(writers.values())).dtypes["bin"]

    def encoded(batches: Iterator[list[Routed]]) -> Iterator[tuple[list[Routed], list[np.ndarray]]]:
        for batch in batches:
            arrays: list[np.ndarray] = []  # compact before they wait for the writer
            parts = by_text_bytes(
                iter(batch), lambda r: r.piece.text, size=ENCODE_BYTES, min_items=ENCODE_MIN_PIECES
            )
            for part in parts:
                texts = [routed.piece.text for routed in part]
                encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
                arrays += token_arrays(encodings, dtype)
                release_free_memory()
            yield batch, arrays

    for batch, ids in read_ahead(encoded(read_ahead(batches_in)), depth=1):
        for split, writer in writers.items():
            pieces = [(r.piece, i) for r, i in zip(batch, ids, strict=True) if r.split == split]
            if pieces:
                advance(_write_pieces(writer, pieces, eos_id, partial(on_shard, split)))


def token_arrays(encodings: list[Encoding], dtype: np.dtype) -> list[np.ndarray]:
    """Each encoding's ids as an array of ``dtype``, emptying ``encodings`` as it goes: an
    encoding (its ids, tokens and offsets: about 100 bytes a token) is freed once converted,
    and no list of a whole batch's ids as Python ints is ever made."""
    encodings.reverse()
    arrays = []
    while encodings:
        arrays.append(np.asarray(encodings.pop().ids, dtype=dtype))  # (tokens of one piece,)
    return arrays


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). A call's encodings are allocated by the library's threads, each in its own
    arena, and freed here; the holes they leave would otherwise stay resident and the peak
    creep up with the length of the corpus."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _write_pieces(
    writer: ShardWriter,
    pieces: list[tuple[Piece, np.ndarray]],
    eos_id: int,
    on_shard: Callable[[Position], None],
) -> int:
    """Append the token arrays of pieces of one split, each document's last piece followed by
    ``eos_id``; calls ``on_shard(position)`` when a shard closes. Returns the bytes of text
    written."""
    eos = np.asarray([eos_id], dtype=writer.dtypes["bin"])
    parts: list[np.ndarray] = []
    counts, sizes, lasts = [], [], []
    for piece, ids in pieces:
        parts += [ids, eos] if piece.last else [ids]
        counts.append(len(ids) + piece.last)
        sizes.append(len(piece.text) if piece.text.isascii() else len(piece.text.encode()))
        lasts.append(piece.last)
    tokens = np.concatenate(parts)  # (tokens of these pieces,)
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
