"""Documents of a corpus, read in bounded pieces: text files, JSON Lines and Parquet, plain or
compressed (gzip, zstd), in a file or a folder that mixes them.

A *document* is a whole text file, one JSON Lines record's text field or one Parquet row's text
field. Documents are numbered in reading order (files sorted by relative path, then records), and
each document is yielded as one or more :class:`Piece` s of whole lines of about
``PIECE_BYTES``, so a huge text file never sits whole in memory. A corpus of a single text file is
one document; :func:`read_pieces` can cut it in two at a byte offset (the tail split).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

PIECE_BYTES = 2**20  # a text document is read in pieces of whole lines of about this size
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIX = ".parquet"
_COMPRESSED = (".gz", ".zst")
_ESTIMATED_RATIO = 4  # a compressed file's text is estimated at this many times its size
_FINGERPRINT_BYTES = 2**16


@dataclass(frozen=True)
class InputFile:
    """One file of a corpus: its path, its name relative to the corpus, and its kind."""

    path: Path
    name: str
    kind: str  # "text", "jsonl" or "parquet"

    @property
    def compression(self) -> str | None:
        return next((c[1:] for c in _COMPRESSED if self.path.name.endswith(c)), None)


@dataclass(frozen=True)
class Piece:
    """A run of whole lines of one document (or the whole document): its text, its document's
    number, its number within the document, and whether it ends the document."""

    text: str
    document: int
    index: int
    last: bool

    @property
    def position(self) -> tuple[int, int]:
        return (self.document, self.index)


def kind_of(path: Path) -> str:
    """``jsonl``, ``parquet`` or ``text`` (anything else, compressed or not)."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIX):
        return "parquet"
    return "text"


def list_inputs(root: Path, names: list[str]) -> list[InputFile]:
    """The non-empty files ``names`` (relative to ``root``) as inputs, in the given order."""
    return [
        InputFile(root / name, name, kind_of(root / name))
        for name in names
        if (root / name).stat().st_size > 0
    ]


def is_single_text(inputs: list[InputFile]) -> bool:
    """A corpus of one text file is one document, split at its tail rather than by document."""
    return len(inputs) == 1 and inputs[0].kind == "text"


def read_pieces(
    inputs: list[InputFile], text_field: str, *, cut: int | None = None
) -> Iterator[Piece]:
    """Every document of ``inputs`` as pieces, in order. With ``cut`` (a single text file), the
    file's first ``cut`` bytes are document 0 and the rest document 1."""
    document = 0
    for item in inputs:
        with errors_name(item):
            if item.kind == "jsonl":
                texts = _jsonl_texts(item, text_field)
            elif item.kind == "parquet":
                texts = _parquet_texts(item, text_field)
            else:
                for text_document in _text_documents(item, cut):
                    yield from _numbered(text_document, document)
                    document += 1
                continue
            for text in texts:
                yield Piece(text, document, 0, True)
                document += 1


def check_inputs(inputs: list[InputFile], text_field: str) -> None:
    """Open every file and read its first document: an unreadable file or a missing field is an
    error before anything is written."""
    for item in inputs:
        with errors_name(item):
            first = next(iter(read_pieces([item], text_field)), None)
        if first is None:
            raise ValueError(
                f"{item.path} holds no document (no record with a {text_field!r} field); "
                "remove it from the corpus or fill it"
            )


def estimated_text_bytes(inputs: list[InputFile]) -> int:
    """About how many bytes of text the corpus holds, from file sizes and Parquet metadata
    (nothing is decompressed): spreads the tokenizer's training sample over the corpus."""
    total = 0
    for item in inputs:
        size = item.path.stat().st_size
        if item.kind == "parquet":
            import pyarrow.parquet as pq

            with errors_name(item):
                metadata = pq.ParquetFile(item.path).metadata
            size = sum(
                metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)
            )
        elif item.compression is not None:
            size *= _ESTIMATED_RATIO
        total += size
    return total


def text_size(item: InputFile) -> int:
    """The decompressed size of a text file in bytes (a counting pass when compressed)."""
    if item.compression is None:
        return item.path.stat().st_size
    total = 0
    with errors_name(item), open_binary(item) as stream:
        while block := stream.read(PIECE_BYTES):
            total += len(block)
    return total


def read_bytes(item: InputFile) -> bytes:
    """A text file's whole (decompressed) bytes: the byte loader reads them at once."""
    with errors_name(item), open_binary(item) as stream:
        return stream.read()


def fingerprint(inputs: list[InputFile]) -> str:
    """A hash of every file's name, size and first and last 64 KiB: equal for an unchanged
    corpus, cheap for a large one."""
    digest = hashlib.sha256()
    for item in inputs:
        size = item.path.stat().st_size
        with open(item.path, "rb") as stream:
            head = stream.read(_FINGERPRINT_BYTES)
            stream.seek(max(0, size - _FINGERPRINT_BYTES))
            tail = stream.read()
        digest.update(f"{item.name}\0{size}\0{zlib.crc32(head)}\0{zlib.crc32(tail)}\n".encode())
    return digest.hexdigest()


def _numbered(texts: Iterator[str], document: int) -> Iterator[Piece]:
    """The pieces of one document, numbered, the last one marked (an empty document is one
    empty piece)."""
    previous = None
    index = 0
    for text in texts:
        if previous is not None:
            yield Piece(previous, document, index, False)
            index += 1
        previous = text
    yield Piece(previous or "", document, index, True)


def _text_documents(item: InputFile, cut: int | None) -> Iterator[Iterator[str]]:
    """A text file as one document of pieces, or two documents split at byte ``cut``."""
    with open_binary(item) as stream:
        if cut is None:
            yield _text_pieces(stream, None)
        else:
            yield _text_pieces(stream, cut)
            yield _text_pieces(stream, None)


def _text_pieces(stream: io.BufferedIOBase | BinaryIO, limit: int | None) -> Iterator[str]:
    """Pieces of whole lines of about ``PIECE_BYTES`` from ``stream`` (at most ``limit`` bytes),
    decoded as UTF-8 (invalid bytes become U+FFFD, as byte-level BPE encodes text)."""
    remaining = limit
    while remaining is None or remaining > 0:
        size = PIECE_BYTES if remaining is None else min(PIECE_BYTES, remaining)
        block = stream.read(size)
        if not block:
            return
        if not block.endswith(b"\n"):
            rest = PIECE_BYTES if remaining is None else remaining - len(block)
            if rest > 0:
                block += stream.readline(rest)
        if remaining is not None:
            remaining -= len(block)
        yield block.decode("utf-8", errors="replace")


def _jsonl_texts(item: InputFile, text_field: str) -> Iterator[str]:
    for record, number in jsonl_records(item):
        yield _field(record, text_field, f"{item.path}, line {number}")


def jsonl_records(item: InputFile) -> Iterator[tuple[object, int]]:
    """Each record of a JSON Lines file and its line number (blank lines skipped)."""
    for line, number in jsonl_lines(item):
        yield json_value(line, f"{item.path}, line {number}"), number


def jsonl_lines(item: InputFile) -> Iterator[tuple[bytes, int]]:
    """Each non-blank line of a JSON Lines file, undecoded, and its line number."""
    with open_binary(item) as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                yield line, number


def json_value(line: bytes, where: str) -> object:
    """The JSON value of one line; a ValueError naming ``where`` when it is not JSON."""
    try:
        return json.loads(line)
    except ValueError as error:
        raise ValueError(f"{where}, is not valid JSON ({error}); fix or remove that line") from None


def parquet_rows(
    item: InputFile, *, columns: list[str] | None = None
) -> Iterator[tuple[dict[str, Any], str]]:
    """Each row of a Parquet file as a dict of ``columns`` (all when None) and where it is."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(item.path)
    for group in range(parquet.num_row_groups):
        rows = parquet.read_row_group(group, columns=columns).to_pylist()
        for row, record in enumerate(rows):
            yield record, f"{item.path}, row group {group}, row {row}"


def _parquet_texts(item: InputFile, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(item.path)
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise ValueError(
            f"{item.path} has no column {text_field!r} (its columns: {', '.join(columns)}); "
            "name the text column with --text-field"
        )
    for group in range(parquet.num_row_groups):
        values = parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        for row, value in enumerate(values):
            if not isinstance(value, str):
                raise ValueError(
                    f"{item.path}, row group {group}, row {row}: column {text_field!r} holds "
                    f"{type(value).__name__}, not text; fix the data or name another column "
                    "with --text-field"
                )
            yield value


def _field(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where}: the record has no {text_field!r} field (it has {keys}); name the text "
            "field with --text-field or fix the record"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(
            f"{where}: field {text_field!r} holds {type(text).__name__}, not text; fix the "
            "record or name another field with --text-field"
        )
    return text


def open_binary(item: InputFile) -> io.BufferedIOBase | BinaryIO:
    """The file's decompressed bytes as a stream."""
    if item.compression == "gz":
        return gzip.open(item.path, "rb")
    if item.compression == "zst":
        import zstandard

        raw = open(item.path, "rb")  # noqa: SIM115 - the reader closes it (closefd)
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, buffer_size=PIECE_BYTES)
    # A large buffer: each refill releases the GIL, and taking it back from a busy thread can
    # wait a switch interval (5 ms), a wait per line with the default 8 KiB.
    return open(item.path, "rb", buffering=PIECE_BYTES)


@contextlib.contextmanager
def errors_name(item: InputFile) -> Iterator[None]:
    """Turn a decompression or format error while reading ``item`` into a ValueError that
    names the file (errors that already name it pass through)."""
    try:
        yield
    except ValueError as error:
        if str(item.path) in str(error):
            raise
        raise _unreadable(item, error) from None
    except (OSError, EOFError, zlib.error) as error:
        raise _unreadable(item, error) from None
    except Exception as error:
        if _is_format_error(error):
            raise _unreadable(item, error) from None
        raise


def _unreadable(item: InputFile, error: BaseException) -> ValueError:
    what = f"{item.compression}-compressed " if item.compression else ""
    return ValueError(
        f"cannot read {what}{item.kind} file {item.path}: {error}; check that the file is "
        "complete and of the kind its name says"
    )


def _is_format_error(error: BaseException) -> bool:
    """zstandard's and pyarrow's own errors (imported only when such a file is read)."""
    module = type(error).__module__ or ""
    return module.startswith(("zstandard", "pyarrow")) or type(error).__name__ == "ZstdError"


def walk_sorted(root: Path, *, skip_dirs: frozenset[str] = frozenset()) -> list[str]:
    """Sorted relative posix paths of the non-hidden regular files below ``root``."""
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
        for filename in sorted(filenames):
            full = Path(dirpath, filename)
            if not filename.startswith(".") and full.is_file():
                names.append(full.relative_to(root).as_posix())
    return sorted(names)
