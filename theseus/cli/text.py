"""``theseus tokenize`` and ``theseus generate``: from text to token files, and from a checkpoint
back to text. Registered by :mod:`theseus.cli.app`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from theseus.cli.options import (
    BaseRun,
    CPUDevices,
    Imports,
    Overwrite,
    RunJob,
    import_modules,
    layout_options,
    log_lines_to_stderr,
    use_cpu_devices,
    user_errors,
)
from theseus.tokenization.text import DEFAULT_SAMPLE_BYTES, DEFAULT_SHARD_TOKENS


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
        Path | None,
        typer.Option(
            help="reuse this tokenizer.json instead of training one; for chat records, the "
            "model's tokenizer folder (tokenizer.json, tokenizer_config.json)"
        ),
    ] = None,
    chat_template: Annotated[
        Path | None,
        typer.Option(help="a Jinja chat template replacing the tokenizer folder's"),
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
    seq_len: Annotated[
        int | None,
        typer.Option(
            help="chat records: also report how the train split packs into rows of this "
            "training.seq_len + 1 tokens; preference records: refuse (or with --overlong drop, "
            "leave out) pairs whose prompt is longer than this",
            min=1,
        ),
    ] = None,
    overlong: Annotated[
        str | None,
        typer.Option(
            help="preference records with --seq-len: a pair whose prompt is longer is an "
            "'error' or is left out, counted in tokens.json ('drop') \\[default: error]"
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="chat records: processes that render and encode \\[default: one per core, "
            "for corpora of several 4 MiB batches]",
            min=1,
        ),
    ] = None,
    overwrite: Overwrite = False,
) -> None:
    """Tokenize a corpus into token shards with byte-level BPE.

    Train on them with data.path=OUT_DIR. The corpus is streamed with bounded memory; run the
    command again to finish an interrupted one. Chat records (messages, or prompt and completion)
    are rendered with the model's chat template and get a loss mask beside their shards;
    preference records (chosen and rejected, with or without a prompt) become pairs whose mask
    marks the completion tokens, as TRL's DPOTrainer tokenizes them.
    """
    with user_errors():
        from theseus.tokenization.chat.corpus import RecordsOptions, is_chat_corpus, tokenize_chat
        from theseus.tokenization.chat.pairs import LongPrompts
        from theseus.tokenization.chat.preference import is_preference_corpus, tokenize_preference
        from theseus.tokenization.text import tokenize as tokenize_corpus

        preference = is_preference_corpus(corpus)
        if overlong is not None and not preference:
            raise ValueError(
                f"--overlong applies to preference records (chosen and rejected), but corpus "
                f"{corpus!r} holds none; drop it or pass a preference corpus"
            )
        if preference or is_chat_corpus(corpus):
            what = "preference" if preference else "chat"
            if vocab_size is not None or tokenizer is None:
                raise ValueError(
                    f"corpus {corpus!r} holds {what} records, which are tokenized with the "
                    "model's own tokenizer and chat template; pass --tokenizer with its "
                    "tokenizer folder (tokenizer.json, tokenizer_config.json) and no --vocab-size"
                )
        options: RecordsOptions = {
            "chat_template": chat_template,
            "eos_token": eos_token,
            "validation_fraction": validation_fraction,
            "seed": seed,
            "shard_tokens": shard_tokens,
            "overwrite": overwrite,
            "seq_len": seq_len,
            "workers": workers,
        }
        if preference:
            assert tokenizer is not None
            # tokenize_preference refuses an --overlong that is neither 'error' nor 'drop'
            limit: LongPrompts = overlong or "error"  # type: ignore[assignment]
            pairs = tokenize_preference(
                corpus, out_dir, tokenizer=tokenizer, overlong=limit, **options
            )
            typer.echo(pairs.describe())
            return
        if is_chat_corpus(corpus):
            assert tokenizer is not None
            typer.echo(tokenize_chat(corpus, out_dir, tokenizer=tokenizer, **options).describe())
            return
        chat_only = (
            ("--chat-template", chat_template),
            ("--seq-len", seq_len),
            ("--workers", workers),
        )
        for name, value in chat_only:
            if value is not None:
                raise ValueError(
                    f"{name} applies to chat and preference records (messages, prompt and "
                    f"completion, or chosen and rejected), but corpus {corpus!r} holds none; "
                    "drop it or pass such a corpus"
                )

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
    run_dir: Annotated[Path, typer.Argument(help="run directory (trained or imported)")],
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
        Path | None,
        typer.Option(
            help="tokenizer.json (with --chat or --messages: the tokenizer folder with its chat "
            "template) \\[default: the run's, else bytes]"
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="print prompts, completions, token ids and tokens/s")
    ] = False,
    prompt_ids: Annotated[
        list[str] | None,
        typer.Option(help="a prompt as comma-separated token ids, e.g. 1,15043,29892 (repeatable)"),
    ] = None,
    chat: Annotated[
        list[str] | None,
        typer.Option(
            help="a user message to reply to with the model's chat template (repeatable: one "
            "conversation each); prints the reply alone"
        ),
    ] = None,
    messages: Annotated[
        Path | None,
        typer.Option(
            help="a JSON file of a conversation ([{role, content}, ...]) or a list of them, to "
            "reply to as --chat does"
        ),
    ] = None,
    job: RunJob = None,
    base: BaseRun = None,
    cpu_devices: CPUDevices = None,
    imports: Imports = None,
    sharding: dict | None = None,
) -> None:
    """Complete prompts with a run's newest good checkpoint (KV cache; any layout)."""
    log_lines_to_stderr()
    use_cpu_devices(cpu_devices)
    import json

    chatting = bool(chat) or messages is not None
    with user_errors():
        if chatting and (prompt or prompt_ids or prompt_file is not None or num_samples != 1):
            raise ValueError(
                "--chat and --messages reply to conversations; drop --prompt, --prompt-ids, "
                "--prompt-file and --num-samples"
            )
        conversations = [[{"role": "user", "content": text}] for text in chat or []]
        if messages is not None:
            conversations += _conversations(messages)
        prompts: list = list(prompt or [])
        prompts += [_token_ids(text) for text in prompt_ids or []]
        if prompt_file is not None:
            lines = prompt_file.read_text().splitlines()
            prompts += [line for line in lines if line.strip()]
        import_modules(imports)
        from theseus.inference import Generation
        from theseus.inference import generate as generate_text
        from theseus.inference.chat import ChatGeneration, generate_chat
        from theseus.inference.generate import GenerationOptions

        options: GenerationOptions = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
            "tokenizer": tokenizer,
            "policy_changes": sharding,
            "job": job,
            "base": base,
        }
        result: Generation | ChatGeneration = (
            generate_chat(run_dir, conversations, **options)
            if chatting
            else generate_text(run_dir, prompts, num_samples=num_samples, **options)
        )
    if json_output:
        from theseus.accounting.records import as_json

        typer.echo(json.dumps(as_json(result), indent=2))
    elif isinstance(result, ChatGeneration):
        for number, reply in enumerate(result.replies):
            if len(result.replies) > 1:
                typer.echo(f"--- conversation {number}", err=True)
            typer.echo(reply.reply)
    else:
        by_ids = len(prompt or [])  # prompts from this index on were given as token ids
        for row, item in enumerate(result.completions):
            typer.echo(f"--- prompt {item.prompt!r}, sample {item.sample}")
            typer.echo(item.prompt + item.completion)
            if by_ids <= row // num_samples < by_ids + len(prompt_ids or []):
                typer.echo(f"--- token ids {item.prompt_ids} + {item.token_ids}")
        typer.echo(
            f"--- {result.new_tokens} new tokens per sample, {result.tokens_per_s:,.0f} "
            f"tokens/s, checkpoint step {result.checkpoint_step}, {result.policy}",
            err=True,
        )


def _conversations(path: Path) -> list:
    """A --messages file: one conversation (a list of messages) or a list of them."""
    import json

    try:
        given = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"--messages {path}: cannot read it as JSON ({error}); fix the file"
        ) from None
    if isinstance(given, list) and given and all(isinstance(m, dict) for m in given):
        return [given]
    if isinstance(given, list) and given and all(isinstance(c, list) for c in given):
        return given
    raise ValueError(
        f"--messages {path} holds neither a conversation (a list of {{role, content}} messages) "
        "nor a list of conversations; write one of them"
    )


def _token_ids(text: str) -> list[int]:
    """``"1,2,3"`` as token ids; anything else is a user error naming it."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--prompt-ids {text!r}: give comma-separated integer token ids, e.g. 1,15043,29892"
        ) from None
