"""``theseus tokenize`` and ``theseus generate``: from text to token files, and from a checkpoint
back to text. Registered by :mod:`theseus.cli.app`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from theseus.cli.options import (
    CPUDevices,
    Imports,
    Overwrite,
    import_modules,
    layout_options,
    log_lines_to_stderr,
    use_cpu_devices,
    user_errors,
)
from theseus.data.bpe import DEFAULT_SAMPLE_BYTES, DEFAULT_SHARD_TOKENS


def tokenize(
    corpus: Annotated[
        str,
        typer.Argument(
            help="text, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet file, gzip- or "
            "zstd-compressed text, a folder mixing them, or 'builtin' (built-in corpus)"
        ),
    ],
    out_dir: Annotated[
        Path, typer.Argument(help="folder for tokenizer.json, token shards and tokens.json")
    ],
    vocab_size: Annotated[
        int | None, typer.Option(help="train a byte-level BPE tokenizer of this many tokens")
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option(help="reuse this tokenizer.json instead of training one")
    ] = None,
    eos_token: Annotated[
        str | None,
        typer.Option(
            help="the token that ends each document \\[default: <|endoftext|>, or a reused "
            "tokenizer's own end-of-text token]"
        ),
    ] = None,
    text_field: Annotated[
        str, typer.Option(help="field of JSON Lines records and column of Parquet files")
    ] = "text",
    validation_fraction: Annotated[
        float, typer.Option(help="share of the documents held out for validation")
    ] = 0.1,
    seed: Annotated[int, typer.Option(help="seed of the split by document")] = 0,
    train_sample_bytes: Annotated[
        int, typer.Option(help="text to train the tokenizer on, taken evenly over the corpus")
    ] = DEFAULT_SAMPLE_BYTES,
    shard_tokens: Annotated[
        int, typer.Option(help="tokens per shard (a shard closes at a piece boundary past it)")
    ] = DEFAULT_SHARD_TOKENS,
    overwrite: Overwrite = False,
) -> None:
    """Tokenize a corpus into token shards with byte-level BPE.

    Train on them with data.path=OUT_DIR. The corpus is streamed with bounded memory; run the
    command again to finish an interrupted one.
    """
    with user_errors():
        from theseus.data.bpe import tokenize as tokenize_corpus

        result = tokenize_corpus(
            corpus,
            out_dir,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            eos_token=eos_token,
            text_field=text_field,
            validation_fraction=validation_fraction,
            seed=seed,
            train_sample_bytes=train_sample_bytes,
            shard_tokens=shard_tokens,
            overwrite=overwrite,
        )
    typer.echo(result.describe())


@layout_options
def generate(
    run_dir: Annotated[Path, typer.Argument(help="run directory of `theseus train` (--out)")],
    prompt: Annotated[
        list[str] | None, typer.Option(help="a prompt to complete (repeatable)")
    ] = None,
    prompt_file: Annotated[
        Path | None, typer.Option(help="a file of prompts, one per line (blank lines skipped)")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to add to each prompt", min=1)] = 64,
    temperature: Annotated[float, typer.Option(help="sampling temperature; 0 is greedy")] = 1.0,
    top_k: Annotated[int | None, typer.Option(help="sample among the k likeliest tokens")] = None,
    top_p: Annotated[
        float | None, typer.Option(help="sample among the likeliest tokens of total mass p")
    ] = None,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    num_samples: Annotated[int, typer.Option(help="completions per prompt", min=1)] = 1,
    tokenizer: Annotated[
        Path | None, typer.Option(help="tokenizer.json \\[default: the run's, else bytes]")
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="print prompts, completions, token ids and tokens/s")
    ] = False,
    prompt_ids: Annotated[
        list[str] | None,
        typer.Option(help="a prompt as comma-separated token ids, e.g. 1,15043,29892 (repeatable)"),
    ] = None,
    job: Annotated[
        str | None, typer.Option(help="registered job of the run \\[default: read from the run]")
    ] = None,
    cpu_devices: CPUDevices = None,
    imports: Imports = None,
    sharding: dict | None = None,
) -> None:
    """Complete prompts with a run's newest good checkpoint (KV cache; any layout)."""
    log_lines_to_stderr()
    use_cpu_devices(cpu_devices)
    import json

    with user_errors():
        prompts: list = list(prompt or [])
        prompts += [_token_ids(text) for text in prompt_ids or []]
        if prompt_file is not None:
            lines = prompt_file.read_text().splitlines()
            prompts += [line for line in lines if line.strip()]
        import_modules(imports)
        from theseus.inference import generate as generate_text

        result = generate_text(
            run_dir,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            num_samples=num_samples,
            tokenizer=tokenizer,
            policy_changes=sharding,
            job=job,
        )
    if json_output:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    for item in result.completions:
        typer.echo(f"--- prompt {item.prompt!r}, sample {item.sample}")
        typer.echo(item.prompt + item.completion)
    typer.echo(
        f"--- {result.new_tokens} new tokens per sample, {result.tokens_per_s:,.0f} tokens/s, "
        f"checkpoint step {result.checkpoint_step}, {result.policy}",
        err=True,
    )


def _token_ids(text: str) -> list[int]:
    """``"1,2,3"`` as token ids; anything else is a user error naming it."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--prompt-ids {text!r}: give comma-separated integer token ids, e.g. 1,15043,29892"
        ) from None
