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
import time
from dataclasses import dataclass
from pathlib import Path

from theseus.data.preference import PREFERENCE_KIND, load_pairs
from theseus.data.shards import SPLITS, TOKENIZED_RECORD, read_json
from theseus.tokenization.chat.corpus import (
    RecordsJob,
    Settings,
    check_options,
    first_corpus_record,
)
from theseus.tokenization.chat.pairs import (
    LongPrompts,
    PromptLimit,
    encode_pair_batch,
    is_preference_record,
)
from theseus.tokenization.text import DEFAULT_SHARD_TOKENS, TokenizedCorpus


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
        c = self.corpus
        again = " (resumed)" if c.resumed else ""
        head = (
            f"wrote {c.out_dir}{again}: {self.pairs['train']:,} + {self.pairs['validation']:,} "
            f"preference pairs (a chosen and a rejected completion each), {c.train_tokens:,} "
            f"train + {c.validation_tokens:,} validation {c.token_dtype} tokens in "
            f"{c.num_shards} shard(s), of which {self.completion_tokens['train']:,} + "
            f"{self.completion_tokens['validation']:,} completion tokens (the mask beside each "
            f"shard), in {c.seconds:.1f} s; the longest pair has {self.longest_pair:,} tokens, "
            f"the longest prompt {self.longest_prompt:,}"
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
    chat_template: str | os.PathLike | None = None,
    eos_token: str | None = None,
    validation_fraction: float = 0.1,
    seed: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    seq_len: int | None = None,
    overlong: LongPrompts = "error",
    workers: int | None = 1,
) -> PreferenceTokenized:
    """Tokenize the preference records of ``corpus`` with the tokenizer folder ``tokenizer``
    (its chat template, or the Jinja file ``chat_template``) into a preference corpus in
    ``out_dir``; running it again on an interrupted folder goes on from its complete shards.
    With ``seq_len``, a pair whose prompt is longer than ``seq_len`` tokens stops it with an
    error naming the record, or is left out (``overlong="drop"``, counted in the manifest).
    ``workers`` as for :func:`~theseus.tokenization.chat.corpus.tokenize_chat`."""
    start = time.perf_counter()
    check_options(seq_len, workers, shard_tokens)
    if overlong not in ("error", "drop"):
        raise ValueError(f"--overlong is 'error' or 'drop', not {overlong!r}; choose one")
    limit = PromptLimit(seq_len, overlong)
    encode = functools.partial(encode_pair_batch, limit)
    own = {"kind": PREFERENCE_KIND, "prompt_limit": seq_len, "overlong": overlong}
    job = RecordsJob.open(
        corpus,
        out_dir,
        Settings(tokenizer, chat_template, eos_token, validation_fraction, seed, shard_tokens),
        own,
        encode,
        overwrite,
    )
    if job.output.finished is not None:
        manifest = read_json(job.output.out / TOKENIZED_RECORD, "manifest")
        fields = job.output.finished
    else:
        records = job.write(workers, encode)
        pairs = {name: job.output.summaries[name]["documents"] for name in SPLITS}
        manifest, fields = job.finish(
            f"preference records {str(corpus)!r}, {len(job.files)} file(s)",
            kind=PREFERENCE_KIND,
            pairs=pairs,
            prompt_limit=seq_len,
            dropped_pairs=records - sum(pairs.values()),
        )
    seconds = time.perf_counter() - start
    return _result(TokenizedCorpus(**fields, seconds=seconds), manifest)


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
