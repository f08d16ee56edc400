"""``theseus tokenize`` of preference records (``chosen`` and ``rejected``, with or without a
``prompt``): each pair tokenized as TRL's ``DPOTrainer`` tokenizes it (:mod:`.pairs`) and written
as a masked corpus (:mod:`theseus.data.shards`) whose examples come in pairs, chosen then
rejected, the mask 1 on the completion tokens, the manifest saying ``"kind": "preference"`` and
counting the pairs; :mod:`theseus.data.preference` reads them back.

As for chat records, the records stream in batches (worker processes encode them), a pair is one
document of the split by document, and an interrupted run resumes from its progress record.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Unpack

from theseus.data.preference import PREFERENCE_KIND, load_pairs
from theseus.data.shards import SPLITS
from theseus.tokenization.chat.corpus import (
    RecordsJob,
    RecordsOptions,
    Settings,
    first_corpus_record,
    run_records_job,
)
from theseus.tokenization.chat.pairs import (
    LongPrompts,
    PromptLimit,
    encode_pair_batch,
    is_preference_record,
)
from theseus.tokenization.text import TokenizedCorpus


@dataclass(frozen=True)
class PreferenceTokenized:
    """What tokenizing preference records wrote: the corpus figures and the pairs'."""

    corpus: TokenizedCorpus
    pairs: dict[str, int]  # pairs of each split
    completion_tokens: dict[str, int]  # the masks' ones of each split, both sides
    longest_pair: int  # tokens of the longest pair (chosen + rejected), train or validation
    longest_prompt: int
    dropped_pairs: int  # prompts longer than prompt_limit (--overlong drop)
    prompt_limit: int | None

    def describe(self) -> str:
        pairs, completions = self.pairs, self.completion_tokens
        head = self.corpus.masked(
            f"{pairs['train']:,} + {pairs['validation']:,} preference pairs (a chosen and a "
            "rejected completion each)",
            f"{completions['train']:,} + {completions['validation']:,} completion tokens",
        ) + (
            f"; the longest pair has {self.longest_pair:,} tokens, the longest prompt "
            f"{self.longest_prompt:,}"
        )
        if self.prompt_limit is None:
            return head + (
                " (a pair whose prompt is longer than training.seq_len trains nothing: --seq-len "
                "checks the prompts here)"
            )
        return head + (
            f"; {self.dropped_pairs:,} pair(s) whose prompt is longer than --seq-len "
            f"{self.prompt_limit} left out"
        )


def is_preference_corpus(corpus: str | os.PathLike) -> bool:
    """Whether ``corpus`` holds preference records: the first record of its first JSON Lines or
    Parquet file holds ``chosen`` or ``rejected``."""
    return is_preference_record(first_corpus_record(corpus))


def tokenize_preference(
    corpus: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike,
    overlong: LongPrompts = "error",
    **options: Unpack[RecordsOptions],
) -> PreferenceTokenized:
    """Tokenize the preference records of ``corpus`` with the tokenizer folder ``tokenizer``
    (its chat template, or the Jinja file ``chat_template``) into a preference corpus in
    ``out_dir``; running it again on an interrupted folder goes on from its complete shards.
    With ``seq_len``, a pair whose prompt is longer than ``seq_len`` tokens stops it with an
    error naming the record, or is left out (``overlong="drop"``, counted in the manifest).
    The other ``options`` as for :func:`~theseus.tokenization.chat.corpus.tokenize_chat`."""
    given = Settings(tokenizer=tokenizer, **options)
    if overlong not in ("error", "drop"):
        raise ValueError(f"--overlong is 'error' or 'drop', not {overlong!r}; choose one")
    encode = functools.partial(encode_pair_batch, PromptLimit(given.seq_len, overlong))
    own = {"kind": PREFERENCE_KIND, "prompt_limit": given.seq_len, "overlong": overlong}

    def finish(job: RecordsJob, records: int) -> tuple[dict, dict]:
        pairs = {name: job.output.summaries[name]["documents"] for name in SPLITS}
        return job.finish(
            f"preference records {str(corpus)!r}, {len(job.files)} file(s)",
            kind=PREFERENCE_KIND,
            pairs=pairs,
            prompt_limit=given.seq_len,
            dropped_pairs=records - sum(pairs.values()),
        )

    return _result(*run_records_job(corpus, out_dir, given, own, encode, finish))


def _result(corpus: TokenizedCorpus, manifest: dict) -> PreferenceTokenized:
    folder = Path(corpus.out_dir)
    splits = {name: load_pairs(folder, name) for name in SPLITS}
    return PreferenceTokenized(
        corpus,
        dict(manifest["pairs"]),
        {name: int(manifest["splits"][name]["trained_tokens"]) for name in SPLITS},
        max(int(s.lengths.sum(axis=1).max()) for s in splits.values()),
        max(int(s.prompt_lengths.max()) for s in splits.values()),
        int(manifest["dropped_pairs"]),
        manifest["prompt_limit"],
    )
