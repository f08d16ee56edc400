"""The inputs and the output folder of ``theseus tokenize``: which files a corpus is, how it is
split, whether an output folder may be written (fresh, resumed, finished, or someone else's), and
cleaning up after a bad input found midway."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from theseus.data.readers import InputFile, check_inputs, is_single_text, list_inputs, text_size
from theseus.data.readers import walk_sorted as _walk
from theseus.data.shards import (
    PROGRESS_FILE,
    SPLITS,
    TOKENIZED_RECORD,
    is_incomplete,
    is_partial,
    own_files,
    read_json,
    write_json_atomic,
)
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


@dataclass(frozen=True)
class OutputState:
    """How ``tokenize`` finds its output folder: fresh, an earlier interrupted run of the same
    settings (its complete shards and positions), or finished (its result fields)."""

    fresh: bool
    splits: dict = field(default_factory=dict)
    finished: dict | None = None


def split_settings(validation_fraction: float, seed: int, shard_tokens: int) -> dict:
    """The settings of a tokenized folder that decide its splits and shards (part of what a
    resumed or finished folder must match)."""
    return {"validation_fraction": validation_fraction, "seed": seed, "shard_tokens": shard_tokens}


def prepare_output(out: Path, settings: dict, *, overwrite: bool) -> OutputState:
    """Decide what to do with ``out``: start fresh (missing or empty, or ``overwrite``: this
    command's files are removed, others left), resume (its progress record has the same
    settings), or nothing (its manifest has them). A folder holding anything else is refused."""
    blank = {name: {"shards": [], "next": (0, 0)} for name in SPLITS}
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} is a file; choose a folder")
    if not out.exists() or not any(out.iterdir()):
        return OutputState(fresh=True, splits=blank)
    if overwrite:
        for name in own_files(out):
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return OutputState(fresh=True, splits=blank)
    manifest, progress = out / TOKENIZED_RECORD, out / PROGRESS_FILE
    if manifest.is_file() and not is_incomplete(out):
        record = read_json(manifest, "manifest")
        if record.get("settings") == settings:
            return OutputState(fresh=False, finished=result_fields(out, record, resumed=False))
        reason = "a tokenized corpus made with other settings or from another corpus"
    elif progress.is_file() and read_json(progress, "progress record").get("settings") == settings:
        splits = read_json(progress, "progress record")["splits"]
        for path in out.iterdir():
            if is_partial(path.name):
                path.unlink()
        return OutputState(fresh=False, splits=splits)
    elif progress.is_file():
        reason = "an interrupted tokenization with other settings or of another corpus"
    else:
        reason = f"files that tokenize did not write ({', '.join(_some(out))})"
    raise ValueError(
        f"output folder {out} holds {reason}; choose an empty or new folder, or pass "
        "--overwrite to replace tokenize's files there"
    )


@contextlib.contextmanager
def cleanup_on_error(out: Path, *, fresh: bool) -> Iterator[None]:
    """When a fresh run stops on a bad input (a ``ValueError`` found midway), remove what it
    wrote, so nothing is left behind; an interrupted or resumed run keeps its complete shards."""
    existed = out.exists()
    try:
        yield
    except ValueError:
        if fresh and out.is_dir():
            if existed:
                for name in own_files(out):
                    (out / name).unlink()
            else:
                shutil.rmtree(out)
        raise


@contextlib.contextmanager
def abandon_on_error(writers: dict) -> Iterator[None]:
    """Whatever stops the writing (a bad input, an interruption), the partial shards go; the
    complete ones stay for a resumed run."""
    try:
        yield
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise


def close_splits(writers: dict, corpus: str | os.PathLike) -> dict:
    """Close each split's last shard; the splits' manifest entries (both must hold documents)."""
    for writer in writers.values():
        writer.close_shard()
    summaries = {name: writers[name].summary() for name in SPLITS}
    check_both_splits(summaries, corpus)
    return summaries


def finish(out: Path, record: dict, *, fresh: bool) -> dict:
    """Write the manifest (the folder trains from now on), drop the progress record; the result
    fields."""
    write_json_atomic(out / TOKENIZED_RECORD, record)
    (out / PROGRESS_FILE).unlink(missing_ok=True)
    return result_fields(out, record, resumed=not fresh)


def check_both_splits(summaries: dict, corpus: str | os.PathLike) -> None:
    for name in SPLITS:
        if not summaries[name]["documents"]:
            raise ValueError(
                f"corpus {str(corpus)!r} gave no {name} document; it needs at least two "
                "documents (or one text file, split at its tail)"
            )


def result_fields(out: Path, record: dict, *, resumed: bool) -> dict:
    """The fields of a ``TokenizedCorpus`` (but ``seconds``) from a manifest."""
    train, validation = (record["splits"][name] for name in SPLITS)
    return {
        "out_dir": str(out),
        "source": record["source"]["description"],
        "vocab_size": record["vocab_size"],
        "token_dtype": record["token_dtype"],
        "eos_token": record["eos_token"],
        "train_tokens": train["tokens"],
        "validation_tokens": validation["tokens"],
        "train_documents": train["documents"],
        "validation_documents": validation["documents"],
        "train_bytes": train["bytes"],
        "validation_bytes": validation["bytes"],
        "num_shards": len(train["shards"]) + len(validation["shards"]),
        "trained_tokenizer": record["trained_tokenizer"],
        "resumed": resumed,
    }


def _some(folder: Path, limit: int = 4) -> list[str]:
    names = sorted(p.name for p in folder.iterdir())
    return names[:limit] + ([f"and {len(names) - limit} more"] if len(names) > limit else [])
