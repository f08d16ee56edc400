"""The corpus type: a corpus is train and validation token arrays and their vocabulary."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from theseus.data.packing import MaskedExamples
from theseus.data.preference import PreferencePairs
from theseus.data.shards import ShardedTokens

#: The vocabulary of byte corpora: one token per byte value.
BYTE_VOCAB_SIZE = 256
_NUM_SAMPLES = 16
_SAMPLE = 4096


@dataclass(frozen=True, eq=False)
class Corpus:
    """Train and validation token arrays (1-D, possibly ``np.memmap``) and their vocabulary."""

    train: np.ndarray | ShardedTokens  # (tokens,): one array, or a split's shards as one
    validation: np.ndarray | ShardedTokens
    vocab_size: int
    source: str
    tokenizer: Path | None = None  # tokenizer.json of a tokenized folder; None: byte or .bin
    eos_id: int | None = None  # the end-of-text token of a tokenized folder
    # A masked (chat or completion) corpus's train and validation examples; None: a stream.
    examples: tuple[MaskedExamples, MaskedExamples] | None = None
    # A preference corpus's train and validation pairs (its examples, two by two); None: none.
    pairs: tuple[PreferencePairs, PreferencePairs] | None = None

    def fingerprint(self) -> dict[str, int]:
        """Sizes and a CRC-32 of evenly spaced samples of both splits: equal on every process
        that reads the same data, cheap for a memory-mapped file (a few pages are read)."""
        crc = 0
        for tokens in (self.train, self.validation):
            step = max(1, tokens.size // _NUM_SAMPLES)
            for start in range(0, tokens.size, step):
                crc = zlib.crc32(np.ascontiguousarray(tokens[start : start + _SAMPLE]).data, crc)
        return {
            "train_tokens": int(self.train.size),
            "validation_tokens": int(self.validation.size),
            "vocab_size": int(self.vocab_size),
            "sample_crc32": crc,
        }


_NUM_SAMPLES = 16
_SAMPLE = 4096


def bytes_to_tokens(data: bytes) -> np.ndarray:
    """The tokens of a byte corpus: one ``uint16`` per byte, read-only."""
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)  # (num_bytes,)
    tokens.setflags(write=False)
    return tokens
