"""Does LoRA DPO learn on an imported model? The user's path, command by command: a tiny random
Llama made by transformers and saved as a Hugging Face folder (byte tokens and an end-of-text
token), `theseus import-hf`; preference records from the built-in corpus (the Python standard
library's source), 16 characters of an ASCII passage as the prompt, its next 24 as the chosen
completion and the same characters shuffled as the rejected one, `theseus tokenize`d as TRL's
DPOTrainer tokenizes text records; `theseus train --job llama/train/preference --init-from` the
import with LoRA adapters (the reference: the base with the adapters off, precomputed); the
validation pairs' reward accuracy and margin every 25 steps; `theseus export-hf` of the merged
model, loaded in transformers and compared with the run's logits.

    python bench/preference_learns.py [--steps 150] [--lora-rank 8] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPT, COMPLETION = 16, 24  # characters (bytes: ASCII)
EOS = "<|endoftext|>"
SEQ_LEN, ROWS, VALIDATION_BATCHES = 127, 16, 8


def theseus(*args: object) -> None:
    """One ``theseus`` command in a process of its own (one CPU device)."""
    command = [sys.executable, "-m", "theseus", *map(str, args)]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def make_model(folder: Path):
    """A random transformers Llama of 2 layers, width 64, over 256 byte tokens and ``EOS``,
    saved with its tokenizer (byte-level BPE, no merges) in ``folder``."""
    import tokenizers
    import torch
    import transformers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, [])
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])  # id 256
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        eos_token_id=256, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return model


def passage_records(text: bytes, count: int, seed: int) -> list[dict[str, str]]:
    """``count`` preference records from non-overlapping ASCII passages of ``text``: a prompt
    of ``PROMPT`` characters, then the next ``COMPLETION`` (chosen) or those shuffled."""
    rng = np.random.default_rng(seed)
    span = PROMPT + COMPLETION
    records: list[dict[str, str]] = []
    for start in rng.permutation(len(text) // span) * span:
        passage = text[start : start + span]
        if max(passage) >= 128 or b"\r" in passage:
            continue
        prompt, real = passage[:PROMPT].decode(), passage[PROMPT:].decode()
        shuffled = "".join(rng.permutation(list(real)))
        if shuffled != real:
            records.append({"prompt": prompt, "chosen": real, "rejected": shuffled})
        if len(records) == count:
            return records
    raise ValueError(f"the corpus holds fewer than {count} ASCII passages")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=4352, help="records (6%% held out)")
    parser.add_argument("--work", type=Path, default=None, help="a new folder for every artifact")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="preference-learns-"))
    work.mkdir(parents=True, exist_ok=args.work is None)

    import torch
    import transformers

    import theseus as api
    from theseus.data import load_corpus
    from theseus.plot import read_metrics

    make_model(work / "hf")
    theseus("import-hf", work / "hf", work / "imported")
    corpus = load_corpus(None)
    records = passage_records(np.asarray(corpus.train, np.uint8).tobytes(), args.pairs, 0)
    with open(work / "pairs.jsonl", "w") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)
    theseus("tokenize", work / "pairs.jsonl", work / "tokens", "--tokenizer", work / "hf",
            "--validation-fraction", 0.06)  # fmt: skip
    theseus(
        "train", "--job", "llama/train/preference", "--init-from", work / "imported",
        "--out", work / "run", "--cpu-devices", 1, f"data.path={work / 'tokens'}",
        f"finetune.lora_rank={args.lora_rank}", f"training.seq_len={SEQ_LEN}",
        f"training.batch_size={ROWS}", f"training.per_device_batch_size={ROWS}",
        f"training.steps={args.steps}", "training.validation_interval=25",
        f"training.validation_batches={VALIDATION_BATCHES}", "optimization.learning_rate=3e-3",
        "optimization.warmup_steps=10",
    )  # fmt: skip
    rows = read_metrics(work / "run")
    print(f"step 1: loss {rows[0]['loss']:.4f} rewards/margins {rows[0]['rewards/margins']:.4f}")
    for row in rows:
        if "val_loss" in row:
            print(
                f"step {row['step']}: val_loss {row['val_loss']:.4f} val_rewards/accuracies "
                f"{row['val_rewards/accuracies']:.3f} val_rewards/margins "
                f"{row['val_rewards/margins']:.4f}"
            )
    theseus("export-hf", work / "run", work / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        work / "merged", dtype=torch.float32
    ).eval()
    ids = np.random.default_rng(1).integers(0, 256, (2, 61))
    ours = api.logits(work / "run", ids)
    with torch.no_grad():
        theirs = merged(torch.tensor(ids)).logits.numpy()
    print(
        f"merged export in transformers: max |logits - run's| = {np.abs(ours - theirs).max():.2e}"
    )


if __name__ == "__main__":
    main()
