"""The scaffold both paths of ``theseus tokenize`` (text and chat) write their output folder
with: its settings, whether it may be written (fresh, resumed, finished, or someone else's), the
progress record and the shard writers of each split, the manifest written last, and cleaning up
after a bad input found midway."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from theseus.data.shards import (
    FORMAT,
    MASK_PATTERN,
    PROGRESS_FILE,
    SHARD_PATTERN,
    SPLITS,
    TOKENIZED_RECORD,
    TOKENIZER_FILE,
    ShardWriter,
    is_incomplete,
    is_partial,
    read_json,
    write_json_atomic,
)
from theseus.tokenization.folder import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE

# The names tokenize writes besides its shards (a chat corpus keeps its tokenizer's
# configuration and chat template beside tokenizer.json).
OWN_NAMES = (
    TOKENIZED_RECORD,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    CHAT_TEMPLATE_FILE,
    PROGRESS_FILE,
)


def sha256(text: str) -> str:
    """The hex SHA-256 of ``text`` (a tokenizer's JSON, as the settings and manifest name it)."""
    return hashlib.sha256(text.encode()).hexdigest()


def settings(
    source: str,
    tokenizer: str,
    own: dict[str, Any],
    validation_fraction: float,
    seed: int,
    shard_tokens: int,
) -> dict[str, Any]:
    """The settings of a tokenized folder, which a resumed or finished folder must match: the
    corpus's fingerprint, the tokenizer's, the path's ``own`` (its end-of-text token among
    them) and what decides its splits and shards."""
    return {
        "format": FORMAT,
        "source": source,
        "tokenizer": tokenizer,
        **own,
        "validation_fraction": validation_fraction,
        "seed": seed,
        "shard_tokens": shard_tokens,
    }


@dataclass(frozen=True)
class OutputState:
    """How ``tokenize`` finds its output folder: fresh, an earlier interrupted run of the same
    settings (its complete shards and positions), or finished (its result fields)."""

    fresh: bool
    splits: dict = field(default_factory=dict)
    finished: dict | None = None


class Output:
    """An output folder being written: its settings, where each split goes on (``resume``: the
    piece after the last one in a complete shard) and its complete shards, kept in the progress
    record after every shard, and the writers of the splits."""

    def __init__(self, out: Path, settings: dict, state: OutputState):
        self.out = out
        self.settings = settings
        self.state = state
        splits = state.splits if state.finished is None else {}  # a finished folder goes on nowhere
        self.resume = {name: tuple(split["next"]) for name, split in splits.items()}
        self.done = {name: list(split["shards"]) for name, split in splits.items()}
        self.writers: dict[str, ShardWriter] = {}
        self.summaries: dict = {}

    @classmethod
    def prepare(cls, out: str | os.PathLike, settings: dict, *, overwrite: bool) -> Output:
        """The output folder ``out`` as :func:`prepare_output` finds it."""
        out = Path(out)
        return cls(out, settings, prepare_output(out, settings, overwrite=overwrite))

    @property
    def finished(self) -> dict | None:
        """The result fields of a folder already finished with these settings, else None."""
        return self.state.finished

    def write_progress(self) -> None:
        splits = {name: {"shards": self.done[name], "next": self.resume[name]} for name in SPLITS}
        write_json_atomic(self.out / PROGRESS_FILE, {"settings": self.settings, "splits": splits})

    def shard_closed(self, name: str, position: tuple[int, int]) -> None:
        """Split ``name`` closed a shard and goes on from ``position``: record it."""
        self.resume[name], self.done[name] = position, self.writers[name].shards
        self.write_progress()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The folder made and its progress record written first (a run killed before its first
        shard resumes too); a fresh run that stops on a bad input leaves nothing behind."""
        with cleanup_on_error(self.out, fresh=self.state.fresh):
            self.out.mkdir(parents=True, exist_ok=True)
            self.write_progress()
            yield

    @contextlib.contextmanager
    def shards(
        self, shard_tokens: int, dtypes: dict[str, str], corpus: str | os.PathLike
    ) -> Iterator[dict[str, ShardWriter]]:
        """A :class:`ShardWriter` per split, going on from the complete shards. Whatever stops
        the writing (a bad input, an interruption), the partial shards go; when it ends, each
        split's last shard is closed and ``summaries`` holds their manifest entries (both
        splits must hold documents of ``corpus``)."""
        self.writers = {
            name: ShardWriter(self.out, name, shard_tokens, dtypes, self.done[name])
            for name in SPLITS
        }
        try:
            yield self.writers
        except BaseException:
            for writer in self.writers.values():
                writer.abandon()
            raise
        for writer in self.writers.values():
            writer.close_shard()
        self.summaries = {name: self.writers[name].summary() for name in SPLITS}
        check_both_splits(self.summaries, corpus)

    def finish(self, description: str, **fields: Any) -> tuple[dict, dict]:
        """Write the manifest (the folder trains from now on): ``fields`` (vocabulary, dtype,
        end-of-text token, tokenizer...), the source, the settings and the splits; drop the
        progress record. The manifest and the result fields."""
        record = {
            "format": FORMAT,
            **fields,
            "source": {"description": description, "fingerprint": self.settings["source"]},
            "settings": self.settings,
            "splits": self.summaries,
        }
        write_json_atomic(self.out / TOKENIZED_RECORD, record)
        (self.out / PROGRESS_FILE).unlink(missing_ok=True)
        return record, result_fields(self.out, record, resumed=not self.state.fresh)


def own_files(folder: Path) -> list[str]:
    """The names in ``folder`` that ``theseus tokenize`` writes (manifest, tokenizer, shards,
    progress, partial shards)."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name in OWN_NAMES
        or SHARD_PATTERN.fullmatch(p.name)
        or MASK_PATTERN.fullmatch(p.name)
        or is_partial(p.name)
    )


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
