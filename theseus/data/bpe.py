"""Byte-level BPE with the Hugging Face ``tokenizers`` library: train a tokenizer on a corpus
(locally; nothing is downloaded) and write the corpus as ``.bin`` token files.

The output folder holds ``tokenizer.json``, ``train.bin``, ``validation.bin`` and ``tokens.json``
(vocabulary size, token dtype, tokens and UTF-8 bytes per split). The split is the one the byte
loader makes of the same corpus (by file for folders and the built-in corpus, a tail split for
one file), so validation losses in nats per byte compare directly with byte-level training.
``load_corpus(folder)`` reads it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from theseus.data.tokens import (
    BYTE_VOCAB_SIZE,
    TOKENIZED_RECORD,
    TOKENIZED_SPLITS,
    TOKENIZER_FILE,
    _check_fraction,
    _walk_sorted,
    builtin_files,
    split_by_file,
    tail_split,
    write_tokens,
)

BUILTIN = "builtin"  # the corpus argument naming the built-in corpus
_CHUNK_BYTES = 2**20  # text is encoded in chunks of whole lines of about this size
_BATCH_CHUNKS = 64  # chunks per encode_batch call
_PROGRESS_MIN_BYTES = 4 * 2**20  # show progress bars from this corpus size on


@dataclass(frozen=True)
class TokenizedCorpus:
    """What ``theseus tokenize`` wrote (the contents of ``tokens.json``)."""

    out_dir: str
    source: str
    vocab_size: int
    token_dtype: str
    train_tokens: int
    validation_tokens: int
    train_bytes: int
    validation_bytes: int
    trained_tokenizer: bool
    seconds: float

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per validation token: nats/token ÷ this = nats/byte."""
        return self.validation_bytes / self.validation_tokens

    def describe(self) -> str:
        how = "trained" if self.trained_tokenizer else "reused"
        return (
            f"wrote {self.out_dir}: {how} a byte-level BPE tokenizer of {self.vocab_size} tokens; "
            f"{self.train_tokens:,} train + {self.validation_tokens:,} validation "
            f"{self.token_dtype} tokens from {self.train_bytes + self.validation_bytes:,} bytes "
            f"({self.bytes_per_token:.3f} bytes per validation token) in {self.seconds:.1f} s; "
            f"train on it with data.path={self.out_dir} model.vocab_size={self.vocab_size}"
        )


def token_dtype(vocab_size: int) -> str:
    """The smallest ``.bin`` dtype that holds ids ``0 .. vocab_size - 1``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def corpus_documents(
    corpus: str | os.PathLike, validation_fraction: float = 0.1, seed: int = 0
) -> tuple[list[bytes], list[bytes], str]:
    """(train documents, validation documents, description), split as ``load_corpus`` splits
    the same bytes: by file for a folder of several files and for the built-in corpus
    (``corpus="builtin"``), the last ``validation_fraction`` of the bytes otherwise."""
    _check_fraction(validation_fraction)
    if str(corpus) == BUILTIN:
        root, names = builtin_files()
        source = f"built-in: Python standard library source ({root}), {len(names)} files"
    else:
        root = Path(corpus)
        if not root.exists():
            raise ValueError(
                f"corpus {str(root)!r} does not exist; pass a text file, a folder of text files, "
                f"or {BUILTIN!r} for the built-in corpus"
            )
        if root.suffix == ".bin" or (root / TOKENIZED_RECORD).is_file():
            raise ValueError(
                f"corpus {str(root)!r} is already tokenized; pass the text it was made from"
            )
        names = [root.name] if root.is_file() else _walk_sorted(root, skip_dirs=frozenset())
        root = root.parent if root.is_file() else root
        names = [name for name in names if (root / name).stat().st_size > 0]
        source = f"{str(Path(corpus))!r}, {len(names)} file(s)"
    if not names:
        raise ValueError(f"corpus {str(corpus)!r} holds no non-empty files; add text to it")
    if len(names) == 1:
        data = (root / names[0]).read_bytes()
        if len(data) < 2:
            raise ValueError(f"corpus {str(corpus)!r} has {len(data)} byte(s); it needs two")
        train, validation = tail_split(np.frombuffer(data, np.uint8), validation_fraction)
        return [train.tobytes()], [validation.tobytes()], source
    train_names, validation_names = split_by_file(names, validation_fraction, seed)
    train = [(root / name).read_bytes() for name in train_names]
    return train, [(root / name).read_bytes() for name in validation_names], source


def train_tokenizer(documents: Sequence[bytes], vocab_size: int, *, progress: bool = False):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens trained on
    ``documents`` (every byte is a token, so any text encodes and decodes losslessly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if not BYTE_VOCAB_SIZE <= vocab_size <= 2**32:
        raise ValueError(
            f"vocab_size={vocab_size}: a byte-level BPE vocabulary holds the "
            f"{BYTE_VOCAB_SIZE} bytes plus merges; choose a size in [{BYTE_VOCAB_SIZE}, 2**32]"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    texts = (chunk for document in documents for chunk in _chunks(document))
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` (a clear error when unreadable)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tokenizer {str(path)!r} does not exist; pass a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the Rust library raises a plain Exception
        raise ValueError(
            f"cannot read tokenizer {str(path)!r}: {error}; pass a Hugging Face tokenizer.json"
        ) from None


def encode_documents(
    tokenizer, documents: Sequence[bytes], dtype: str, advance: Callable[[int], None]
) -> np.ndarray:
    """The concatenated token ids of ``documents`` (no separator), as a ``dtype`` array; calls
    ``advance(num_bytes)`` as batches of chunks are done (encoded in parallel by the library)."""
    chunks = [chunk for document in documents for chunk in _chunks(document)]
    pieces = []
    for start in range(0, len(chunks), _BATCH_CHUNKS):
        batch = chunks[start : start + _BATCH_CHUNKS]
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        pieces += [np.asarray(encoding.ids, dtype=dtype) for encoding in encodings]
        advance(sum(len(chunk.encode()) for chunk in batch))
    return np.concatenate(pieces)


def tokenize(
    corpus: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    validation_fraction: float = 0.1,
    overwrite: bool = False,
    progress: bool | None = None,
) -> TokenizedCorpus:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens on the train split of
    ``corpus`` (or reuse the ``tokenizer.json`` at ``tokenizer``) and write the tokenized
    corpus to ``out_dir``. ``progress`` shows bars (default: for corpora of 4 MiB or more)."""
    if (vocab_size is None) == (tokenizer is None):
        raise ValueError(
            "give exactly one of vocab_size (train a tokenizer) and tokenizer (reuse a "
            "tokenizer.json)"
        )
    out = Path(out_dir)
    present = [
        n for n in (TOKENIZED_RECORD, TOKENIZER_FILE, *TOKENIZED_SPLITS) if (out / n).exists()
    ]
    if present and not overwrite:
        raise ValueError(
            f"{out} already holds {', '.join(present)}; pass --overwrite to replace them or "
            "choose another output folder"
        )
    start = time.perf_counter()
    train_docs, validation_docs, source = corpus_documents(corpus, validation_fraction)
    documents = [*train_docs, *validation_docs]
    total_bytes = sum(len(d) for d in documents)
    progress = total_bytes >= _PROGRESS_MIN_BYTES if progress is None else progress
    if tokenizer is None:
        bpe = train_tokenizer(train_docs, vocab_size, progress=progress)
    else:
        bpe = load_tokenizer(tokenizer)
    size = bpe.get_vocab_size()
    dtype = token_dtype(size)
    out.mkdir(parents=True, exist_ok=True)
    with _byte_progress(progress, total_bytes) as advance:
        splits = [
            encode_documents(bpe, docs, dtype, advance) for docs in (train_docs, validation_docs)
        ]
    for name, tokens in zip(TOKENIZED_SPLITS, splits, strict=True):
        write_tokens(out / name, tokens, dtype, vocab_size=size)
    bpe.save(str(out / TOKENIZER_FILE))
    result = TokenizedCorpus(
        out_dir=str(out),
        source=source,
        vocab_size=size,
        token_dtype=dtype,
        train_tokens=int(splits[0].size),
        validation_tokens=int(splits[1].size),
        train_bytes=sum(len(_text(d).encode()) for d in train_docs),
        validation_bytes=sum(len(_text(d).encode()) for d in validation_docs),
        trained_tokenizer=tokenizer is None,
        seconds=time.perf_counter() - start,
    )
    (out / TOKENIZED_RECORD).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result


def _text(document: bytes) -> str:
    """UTF-8 text of a document; invalid bytes become U+FFFD (byte-level BPE encodes text)."""
    return document.decode("utf-8", errors="replace")


def _chunks(document: bytes) -> Iterator[str]:
    """The document's text in pieces of whole lines of about ``_CHUNK_BYTES``."""
    text = _text(document)
    start = 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK_BYTES)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


@contextlib.contextmanager
def _byte_progress(enabled: bool, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over bytes encoded; yields its ``advance`` (a no-op when disabled)."""
    if not enabled:
        yield lambda _: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    with Progress(TextColumn("[bold]encode"), BarColumn(), DownloadColumn()) as progress:
        task = progress.add_task("encode", total=total)
        yield lambda num_bytes: progress.advance(task, num_bytes)
