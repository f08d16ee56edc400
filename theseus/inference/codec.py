"""Text to token ids and back for generation: UTF-8 bytes, or a run's BPE tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from theseus.data.bpe import load_tokenizer
from theseus.data.tokens import BYTE_VOCAB_SIZE, TOKENIZED_RECORD, TOKENIZER_FILE


class Codec(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def description(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteCodec:
    """Each UTF-8 byte is a token (the byte corpora's encoding) in a vocabulary of
    ``vocab_size`` ids (a model's may exceed the 256 bytes): an id that is no byte is shown as
    ``⟨id⟩``."""

    vocab_size: int = BYTE_VOCAB_SIZE
    description: str = "UTF-8 bytes"

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
    """A Hugging Face ``tokenizer.json`` (byte-level BPE from ``theseus tokenize``)."""

    def __init__(self, path: Path):
        self.tokenizer = load_tokenizer(path)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.description = f"tokenizer {path} ({self.vocab_size} tokens)"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def resolve_codec(
    run_dirs: list[Path], tokenizer: str | Path | None, data_path: str | None, model_vocab: int
) -> Codec:
    """``tokenizer`` when given, else the ``tokenizer.json`` of the first of ``run_dirs`` (the
    run, then the run it fine-tunes) that has one, else the tokenizer of the tokenized folder it
    trained on (``data_path``, the run's ``data.path``), else bytes over the model's
    vocabulary; it must fit the model's vocabulary."""
    folder = Path(data_path) if data_path else None
    own = next((d / TOKENIZER_FILE for d in run_dirs if (d / TOKENIZER_FILE).is_file()), None)
    run_dir = run_dirs[0]
    if tokenizer is not None:
        codec: Codec = TokenizerCodec(Path(tokenizer))
    elif own is not None:
        codec = TokenizerCodec(own)
    elif folder is not None and (folder / TOKENIZER_FILE).is_file():
        codec = TokenizerCodec(folder / TOKENIZER_FILE)
    elif folder is not None and (folder.suffix == ".bin" or (folder / TOKENIZED_RECORD).exists()):
        raise ValueError(
            f"{run_dir} was trained on token ids (data.path={data_path}) and no tokenizer.json "
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
