"""The inputs of ``theseus tokenize`` of text: which files a corpus is and how it is split."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from theseus.data.readers import InputFile, check_inputs, is_single_text, list_inputs, text_size
from theseus.data.readers import walk_sorted as _walk
from theseus.data.shards import TOKENIZED_RECORD
from theseus.data.split import DocumentSplit, split_by_file, tail_split_size
from theseus.data.tokens import builtin_files

BUILTIN = "builtin"  # the corpus argument naming the built-in corpus


@dataclass(frozen=True)
class CorpusInputs:
    """A corpus's files in reading order, its description, and for the built-in corpus the
    names of its validation files (it keeps its by-name split, as the byte loader does)."""

    files: list[InputFile]
    description: str
    builtin_validation: frozenset[str] | None = None

    def splitter(self, fraction: float, seed: int) -> Callable[[int], str]:
        """Document position → ``"train"`` or ``"validation"``, as the byte loader splits."""
        validation = self.builtin_validation
        if validation is not None:
            names = [f.name for f in self.files]
            return lambda d: "validation" if names[d] in validation else "train"
        if is_single_text(self.files):  # documents 0 and 1 are the two sides of the tail cut
            return lambda d: "validation" if d == 1 else "train"
        split = DocumentSplit(fraction, seed)
        return lambda d: "validation" if split.is_validation(d) else "train"


def corpus_inputs(
    corpus: str | os.PathLike, text_field: str, fraction: float, seed: int
) -> CorpusInputs:
    """The files of ``corpus`` (a file, a folder, or ``"builtin"``), each opened and its first
    document read, so a bad input is an error before anything is written."""
    if str(corpus) == BUILTIN:
        root, names = builtin_files()
        _, validation = split_by_file(names, fraction, seed)
        files = list_inputs(root, names)
        description = f"built-in: Python standard library source ({root}), {len(files)} files"
        return CorpusInputs(files, description, frozenset(validation))
    root = Path(corpus)
    if not root.exists():
        raise ValueError(
            f"corpus {str(root)!r} does not exist; pass a text, JSON Lines or Parquet file, a "
            f"folder of them, or {BUILTIN!r} for the built-in corpus"
        )
    if root.suffix == ".bin" or (root / TOKENIZED_RECORD).is_file():
        raise ValueError(
            f"corpus {str(root)!r} is already tokenized; pass the text it was made from"
        )
    if root.is_file():
        files = list_inputs(root.parent, [root.name])
    else:
        files = list_inputs(root, _walk(root))
    if not files:
        raise ValueError(f"corpus {str(corpus)!r} holds no non-empty files; add text to it")
    check_inputs(files, text_field)
    kinds = sorted({f.kind for f in files})
    return CorpusInputs(files, f"{str(root)!r}, {len(files)} file(s) ({', '.join(kinds)})")


def tail_cut(inputs: CorpusInputs, fraction: float) -> int | None:
    """For a single text file, the byte offset where validation begins (the byte loader's tail
    split); None for corpora split by document."""
    if inputs.builtin_validation is not None or not is_single_text(inputs.files):
        return None
    size = text_size(inputs.files[0])
    if size < 2:
        raise ValueError(f"corpus {inputs.files[0].path} has {size} byte(s); it needs two")
    return size - tail_split_size(size, fraction)
