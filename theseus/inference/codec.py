"""Text to token ids and back for generation: UTF-8 bytes, or a run's tokenizer folder (its
end-of-sequence ids too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from theseus.data.tokens import BYTE_VOCAB_SIZE, TOKENIZED_RECORD
from theseus.tokenization.folder import TokenizerFolder


class Codec(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def description(self) -> str: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...  # the ids that end a generation, as HF's do

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteCodec:
    """Each UTF-8 byte is a token (the byte corpora's encoding) in a vocabulary of
    ``vocab_size`` ids (a model's may exceed the 256 bytes): an id that is no byte is shown as
    ``⟨id⟩``."""

    vocab_size: int = BYTE_VOCAB_SIZE
    description: str = "UTF-8 bytes"
    eos_ids: tuple[int, ...] = ()  # bytes have no end-of-sequence token

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        pieces, run = [], bytearray()
        for token in ids:
            if 0 <= token < BYTE_VOCAB_SIZE:
                run.append(token)
                continue
            pieces.append(run.decode("utf-8", errors="replace"))
            pieces.append(f"⟨{token}⟩")
            run = bytearray()
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)


class TokenizerCodec:
    """A tokenizer folder's ``tokenizer.json`` (byte-level BPE from ``theseus tokenize``, or a
    model's) and its end-of-sequence ids (:attr:`TokenizerFolder.eos_ids`)."""

    def __init__(self, folder: TokenizerFolder):
        self.tokenizer = folder.tokenizer
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.description = f"tokenizer {folder.tokenizer_file} ({self.vocab_size} tokens)"
        self.folder = folder

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.folder.eos_ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def resolve_codec(
    run_dirs: list[Path], tokenizer: str | Path | None, data_path: str | None, model_vocab: int
) -> Codec:
    """``tokenizer`` when given, else the tokenizer folder of ``run_dirs`` (the run, then the
    run it fine-tunes) or of the tokenized folder it trained on (``data_path``, the run's
    ``data.path``), found by :meth:`TokenizerFolder.find`, else bytes over the model's
    vocabulary; it must fit the model's vocabulary."""
    found = TokenizerFolder.find(tokenizer, [*run_dirs, data_path])
    data = Path(data_path) if data_path else None
    if found is not None:
        codec: Codec = TokenizerCodec(found)
    elif data is not None and (data.suffix == ".bin" or (data / TOKENIZED_RECORD).exists()):
        raise ValueError(
            f"{run_dirs[0]} was trained on token ids (data.path={data_path}) and no tokenizer.json "
            "was found for them; pass --tokenizer PATH/tokenizer.json"
        )
    else:
        codec = ByteCodec(vocab_size=model_vocab)
    if codec.vocab_size > model_vocab:
        raise ValueError(
            f"the {codec.description} does not match the checkpoint: it has {codec.vocab_size} "
            f"token ids but the model's vocabulary has {model_vocab}; pass the tokenizer the run "
            "was trained with (--tokenizer PATH), or none for the run's own"
        )
    return codec
