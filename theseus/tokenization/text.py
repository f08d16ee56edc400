"""``theseus tokenize``: byte-level BPE with the Hugging Face ``tokenizers`` library (trained
locally on a bounded sample, or reused), and a corpus streamed into token shards.

The output folder holds ``tokenizer.json``, ``train-NNNNN.bin`` / ``validation-NNNNN.bin``
shards and the ``tokens.json`` manifest (see :mod:`theseus.data.shards`), written last. The
split is by document (:mod:`theseus.data.split`; a single text file is cut at its tail), the one
the byte loader makes of the same corpus, so losses compare in nats per byte. Every document ends
with the end-of-text token. ``load_corpus(folder)`` reads it back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from theseus.config import check_int, is_int
from theseus.data.readers import Piece, estimated_text_bytes, fingerprint, read_pieces
from theseus.data.shards import TOKENIZER_FILE
from theseus.data.tokens import BYTE_VOCAB_SIZE
from theseus.tokenization.folder import EOS_TOKEN, TokenizerFolder, candidate_eos, load_tokenizer
from theseus.tokenization.inputs import corpus_inputs, tail_cut
from theseus.tokenization.output import Output, settings, sha256
from theseus.tokenization.streaming import batches, encode_stream

DEFAULT_SAMPLE_BYTES = 64 * 2**20  # text a tokenizer is trained on, spread over the corpus
DEFAULT_SHARD_TOKENS = 2**26
_PROGRESS_MIN_BYTES = 4 * 2**20  # show progress bars from this corpus size on


@dataclass(frozen=True)
class TokenizedCorpus:
    """What ``theseus tokenize`` wrote (the figures of ``tokens.json``)."""

    out_dir: str
    source: str
    vocab_size: int
    token_dtype: str
    eos_token: str
    train_tokens: int
    validation_tokens: int
    train_documents: int
    validation_documents: int
    train_bytes: int
    validation_bytes: int
    num_shards: int
    trained_tokenizer: bool
    resumed: bool
    seconds: float

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per validation token: nats/token ÷ this = nats/byte."""
        return self.validation_bytes / self.validation_tokens

    def describe(self) -> str:
        how = "trained" if self.trained_tokenizer else "reused"
        again = " (resumed)" if self.resumed else ""
        return (
            f"wrote {self.out_dir}{again}: {how} a byte-level BPE tokenizer of {self.vocab_size} "
            f"tokens; {self.train_tokens:,} train + {self.validation_tokens:,} validation "
            f"{self.token_dtype} tokens in {self.num_shards} shard(s) from "
            f"{self.train_documents:,} + {self.validation_documents:,} documents, "
            f"{self.train_bytes + self.validation_bytes:,} bytes "
            f"({self.bytes_per_token:.3f} bytes per validation token), each document ending "
            f"with {self.eos_token}, in {self.seconds:.1f} s; train on it with "
            f"data.path={self.out_dir} model.vocab_size={self.vocab_size}"
        )

    def masked(self, examples: str, masked: str) -> str:
        """How a masked corpus (chat or preference records) begins its description: what was
        written (``examples``, counted), its tokens and shards, of which ``masked`` (the ones
        of the mask beside each shard), and the time."""
        again = " (resumed)" if self.resumed else ""
        return (
            f"wrote {self.out_dir}{again}: {examples}, {self.train_tokens:,} train + "
            f"{self.validation_tokens:,} validation {self.token_dtype} tokens in "
            f"{self.num_shards} shard(s), of which {masked} (the mask beside each shard), in "
            f"{self.seconds:.1f} s"
        )


def token_dtype(vocab_size: int) -> str:
    """The smallest ``.bin`` dtype that holds ids ``0 .. vocab_size - 1``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def train_tokenizer(texts: Iterator[str], vocab_size: int, *, progress: bool = False):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens trained on ``texts``:
    the end-of-text token, every byte (so any text encodes and decodes losslessly) and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
        show_progress=progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def check_vocab_size(vocab_size: int) -> None:
    if not is_int(vocab_size):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    smallest = BYTE_VOCAB_SIZE + 1
    if not smallest <= vocab_size <= 2**32:
        raise ValueError(
            f"vocab_size={vocab_size}: a byte-level BPE vocabulary holds the end-of-text token, "
            f"the {BYTE_VOCAB_SIZE} bytes and merges; choose a size in [{smallest}, 2**32]"
        )


def end_of_text(tokenizer, name: str | None, where: str) -> tuple[str, int]:
    """The token that ends each document (text and id): ``name`` when given, else the first of
    :data:`~theseus.tokenization.folder.EOS_CANDIDATES` among the tokenizer's special tokens
    (Qwen's ``<|endoftext|>``, not its chat's end of turn)."""
    if name is not None:
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            raise ValueError(
                f"--eos-token {name!r} is not a token of {where}; name one of its tokens"
            )
        return name, token_id
    candidate = candidate_eos(tokenizer)
    if candidate is None:
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        raise ValueError(
            f"{where} has no end-of-text token among its special tokens "
            f"({', '.join(sorted(special)) or 'none'}); name the token that ends a document with "
            "--eos-token"
        )
    return candidate, tokenizer.token_to_id(candidate)


def tokenize(
    corpus: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    eos_token: str | None = None,
    text_field: str = "text",
    validation_fraction: float = 0.1,
    seed: int = 0,
    train_sample_bytes: int = DEFAULT_SAMPLE_BYTES,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool | None = None,
) -> TokenizedCorpus:
    """Tokenize ``corpus`` into shards in ``out_dir`` with a byte-level BPE tokenizer trained on
    an evenly spread ``train_sample_bytes`` of its train split (``vocab_size``) or reused
    (``tokenizer``). Running it again on an interrupted folder goes on from its complete shards;
    a finished one with the same settings is left as it is. ``progress`` shows bars (default:
    for corpora of 4 MiB or more)."""
    start = time.perf_counter()
    if (vocab_size is None) == (tokenizer is None):
        raise ValueError(
            "give exactly one of vocab_size (train a tokenizer) and tokenizer (reuse a "
            "tokenizer.json)"
        )
    for name, value in (("train_sample_bytes", train_sample_bytes), ("shard_tokens", shard_tokens)):
        check_int(name, value, minimum=1)
    if vocab_size is not None:
        check_vocab_size(vocab_size)
    source = corpus_inputs(corpus, text_field, validation_fraction, seed)
    inputs = source.files
    given = None if tokenizer is None else TokenizerFolder.at(tokenizer)
    reused = None if given is None else given.tokenizer
    if reused is not None:
        eos_token, _ = end_of_text(reused, eos_token, f"tokenizer {tokenizer}")
    own = {
        "train_sample_bytes": None if reused else train_sample_bytes,
        "eos_token": eos_token,
        "text_field": text_field,
    }
    tokenizer_id = sha256(reused.to_str()) if reused else f"train {vocab_size}"
    output = Output.prepare(
        out_dir,
        settings(fingerprint(inputs), tokenizer_id, own, validation_fraction, seed, shard_tokens),
        overwrite=overwrite,
    )
    if output.finished is not None:
        return TokenizedCorpus(**output.finished, seconds=time.perf_counter() - start)
    out = output.out
    total_bytes = estimated_text_bytes(inputs)
    progress = total_bytes >= _PROGRESS_MIN_BYTES if progress is None else progress
    cut = tail_cut(source, validation_fraction)
    split_of = source.splitter(validation_fraction, seed)

    def pieces() -> Iterator[Piece]:
        return read_pieces(inputs, text_field, cut=cut)

    with output.writing():  # a run killed while training its tokenizer resumes too
        if reused is None and not (out / TOKENIZER_FILE).is_file():
            texts = sample_texts(pieces(), split_of, total_bytes, train_sample_bytes)
            assert vocab_size is not None  # checked above: a tokenizer or a vocabulary size
            bpe = train_tokenizer(texts, vocab_size, progress=progress)
            bpe.save(str(out / TOKENIZER_FILE))
        elif reused is None:
            bpe = load_tokenizer(out / TOKENIZER_FILE)  # trained before the interruption
        else:
            bpe = reused
            assert given is not None  # reused is the tokenizer of this folder
            shutil.copyfile(given.tokenizer_file, out / TOKENIZER_FILE)
        eos_token, eos_id = end_of_text(bpe, eos_token, f"tokenizer {out / TOKENIZER_FILE}")
        dtype = token_dtype(bpe.get_vocab_size())
        with (
            output.shards(shard_tokens, {"bin": dtype}, corpus) as writers,
            _byte_progress(progress, total_bytes) as advance,
        ):
            encode_stream(
                batches(pieces(), split_of, output.resume),
                bpe,
                eos_id=eos_id,
                writers=writers,
                on_shard=output.shard_closed,
                advance=advance,
            )
    _, result = output.finish(
        source.description,
        vocab_size=bpe.get_vocab_size(),
        token_dtype=dtype,
        eos_token=eos_token,
        eos_id=eos_id,
        tokenizer_sha256=sha256(bpe.to_str()),
        trained_tokenizer=reused is None,
    )
    return TokenizedCorpus(**result, seconds=time.perf_counter() - start)


def sample_texts(
    pieces: Iterator[Piece], split_of: Callable[[int], str], total_bytes: int, sample_bytes: int
) -> Iterator[str]:
    """About ``sample_bytes`` of the train split's text, taken evenly over the corpus (a piece
    is taken when the running share of the bytes seen reaches it), never more."""
    share = min(1.0, sample_bytes / max(1, total_bytes))
    credit = 0.0
    taken = 0
    for piece in pieces:
        if split_of(piece.document) != "train":
            continue
        size = len(piece.text)
        credit += share * size
        if credit >= size:
            credit -= size
            if taken + size > sample_bytes:
                return
            taken += size
            yield piece.text


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
