"""The byte loader's by-document split of a folder (or a JSON Lines or Parquet file): the same
documents, in the same order and split, as ``theseus tokenize`` makes of the same corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from theseus.data.corpus import bytes_to_tokens
from theseus.data.readers import InputFile, read_pieces
from theseus.data.split import DocumentSplit


def split_documents(
    inputs: list[InputFile], text_field: str, validation_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) UTF-8 bytes of the documents of ``inputs``, each split's documents
    concatenated without separator. Plain text files are read as their raw bytes; JSON Lines,
    Parquet and compressed files as the UTF-8 of their text."""
    split = DocumentSplit(validation_fraction, seed)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    document = 0
    for item in inputs:
        if item.kind == "text" and item.compression is None:
            parts[split.is_validation(document)].append(Path(item.path).read_bytes())
            document += 1
            continue
        last = document
        for piece in read_pieces([item], text_field):
            last = document + piece.document
            parts[split.is_validation(last)].append(piece.text.encode())
        document = last + 1
    train, validation = (bytes_to_tokens(b"".join(parts[side])) for side in (False, True))
    return train, validation
