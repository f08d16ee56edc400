"""Preference data: pairs tokenized as TRL's ``DPOTrainer`` tokenizes them (ids and completion
masks equal to TRL's own dataset preparation and collator, text and conversational records,
explicit and implicit prompts, Llama 3 and Qwen2.5 templates), written as a preference corpus
streamed and resumed, read back as pairs, bad input refused.
"""

import gzip
import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_tokenizers import CONVERSATIONS, TOOLS, tokenizer_folders
from hf_reference import libraries
from support import interrupted_records, invoke, trl_module

import theseus.tokenization.chat.corpus as chat_corpus
from theseus.config import DataConfig
from theseus.data import load_corpus, load_mixture
from theseus.data.preference import load_pairs
from theseus.data.shards import PROGRESS_FILE, read_manifest
from theseus.data.split import DocumentSplit
from theseus.tokenization.chat.encoder import ChatEncoder
from theseus.tokenization.chat.pairs import encode_pairs, parse_pair
from theseus.tokenization.chat.preference import tokenize_preference

TALK = CONVERSATIONS[0]["messages"]  # system, user, assistant, user, assistant
WEATHER = CONVERSATIONS[2]["messages"]  # tool calls and tool replies
# Records of each form, grouped as TRL reads a dataset (its first record decides the form).
FORMS = {
    "text": [
        {"prompt": "Translate: café →", "chosen": " coffee shop", "rejected": " tea room"},
        {"prompt": "Hi", "chosen": " there<|eot_id|>", "rejected": " you<|im_end|>"},
    ],
    "implicit text": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Answer: yes", "rejected": "Answer: no"},  # the space goes to the completion
        {"chosen": "abc", "rejected": "abcd"},  # one begins the other
    ],
    "conversation": [
        {
            "prompt": TALK[:4],
            "chosen": TALK[4:],
            "rejected": [{"role": "assistant", "content": "?"}],
        },
        {
            "prompt": TALK[1:2],
            "chosen": TALK[2:5],  # a completion of several turns
            "rejected": [{"role": "assistant", "content": "A naïve one. 😀"}],
        },
    ],
    "implicit conversation": [
        {"chosen": TALK[:3], "rejected": [*TALK[:2], {"role": "assistant", "content": "A cafe."}]},
        {"chosen": TALK, "rejected": [*TALK[:4], {"role": "assistant", "content": "Delta."}]},
    ],
    "tools": [
        {
            "prompt": WEATHER[:1],
            "chosen": WEATHER[1:],
            "rejected": [{"role": "assistant", "content": "I cannot tell."}],
            "tools": TOOLS,
        }
    ],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tokenizer_folders(tmp_path_factory.mktemp("preference-tokenizers"))


def _trl_pairs(trl, transformers, folder, records, tmp_path) -> list[tuple[list, list]]:
    """Each example's (ids, completion mask) as TRL makes them: ``DPOTrainer``'s dataset
    preparation (prompt extraction, end-of-text, tokenizing) and ``DataCollatorForPreference``;
    chosen examples first, then rejected, padding left out."""
    import datasets
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    args = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    args.max_length = None  # no truncation: the ids as tokenized
    prepared = DPOTrainer._prepare_dataset(  # the trainer's own step, without a model
        SimpleNamespace(_tokenizer=tokenizer),
        datasets.Dataset.from_list(records),
        tokenizer,
        args,
        "train",
    )
    batch = DataCollatorForPreference(pad_token_id=0)([dict(row) for row in prepared])
    rows = []
    for ids, attention, completion in zip(
        batch["input_ids"], batch["attention_mask"], batch["completion_mask"], strict=True
    ):
        kept = attention.bool()
        rows.append((ids[kept].tolist(), completion[kept].tolist()))
    return rows


def test_ids_and_completion_masks_equal_trl(folders, tmp_path):
    transformers, trl = libraries().transformers, trl_module()
    import datasets  # TRL's dependency

    datasets.logging.disable_progress_bar()
    for name in ("llama3", "qwen25"):
        encoder = ChatEncoder.from_folder(folders[name])
        for form, records in FORMS.items():
            if name == "llama3" and form == "tools":
                continue  # Llama 3's template has no tool calls
            theirs = _trl_pairs(trl, transformers, folders[name], records, tmp_path)
            pairs = [parse_pair(raw, k, "test") for k, raw in enumerate(records)]
            for k, pair in enumerate(encode_pairs(encoder, pairs)):
                for side, ids in enumerate((pair.chosen, pair.rejected)):
                    mask = (np.arange(ids.size) >= pair.prompt_length).astype(int).tolist()
                    want_ids, want_mask = theirs[side * len(records) + k]
                    assert ids.tolist() == want_ids, (name, form, k, side)
                    assert mask == want_mask, (name, form, k, side)
    # What TRL's completion holds: Qwen's turn end and the newline after it, Llama's BOS once.
    qwen = ChatEncoder.from_folder(folders["qwen25"])
    pair = encode_pairs(qwen, [parse_pair(FORMS["conversation"][0], 0, "test")])[0]
    completion = qwen.tokenizer.decode(pair.chosen[pair.prompt_length :].tolist(), False)
    assert completion == TALK[4]["content"] + "<|im_end|>\n"
    llama = ChatEncoder.from_folder(folders["llama3"])
    pair = encode_pairs(llama, [parse_pair(FORMS["text"][0], 0, "test")])[0]
    bos = llama.tokenizer.token_to_id("<|begin_of_text|>")
    assert pair.chosen[0] == bos and (pair.chosen == bos).sum() == 1
    assert pair.chosen[-1] == llama.eos_id == pair.rejected[-1]


def _records(count: int) -> list[dict]:
    """Pairs of every form, their replies made distinct and of varied lengths."""
    every = [raw for form, group in FORMS.items() if form != "tools" for raw in group]
    records = []
    for index in range(count):
        raw = json.loads(json.dumps(every[index % len(every)]))
        tail = f" ({index})" * (1 + index % 4)
        if isinstance(raw["chosen"], str):
            raw["chosen"] += tail
        else:
            raw["chosen"][-1]["content"] += tail
        records.append(raw)
    return records


def _write_corpus(folder, records) -> list[dict]:
    """Text records in gzip JSON Lines, conversations in Parquet: the records in reading order."""
    folder.mkdir()
    texts = [r for r in records if isinstance(r["chosen"], str)]
    talks = [r for r in records if not isinstance(r["chosen"], str)]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in texts)
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    pq.write_table(pa.Table.from_pylist(talks), folder / "b.parquet", row_group_size=7)
    return texts + talks


def test_preference_corpus_streams_resumes_and_reads_pairs(folders, tmp_path, monkeypatch):
    monkeypatch.setattr("theseus.tokenization.streaming.BATCH_BYTES", 2000)  # several batches
    corpus = tmp_path / "pairs"
    read = _write_corpus(corpus, _records(64))
    tokenizer = folders["qwen25"]
    whole = tokenize_preference(  # encoded by 2 worker processes
        corpus, tmp_path / "whole", tokenizer=tokenizer, shard_tokens=700, workers=2
    )
    manifest = read_manifest(tmp_path / "whole")
    assert manifest.data["kind"] == "preference" and manifest.data["loss_mask"]
    assert whole.corpus.num_shards > 4 and manifest.data["dropped_pairs"] == 0
    encoder = ChatEncoder.from_folder(tokenizer)
    split = DocumentSplit(0.1, 0)
    for name in ("train", "validation"):
        numbers = [k for k in range(len(read)) if split.is_validation(k) == (name == "validation")]
        wanted = encode_pairs(encoder, [parse_pair(read[k], k, "test") for k in numbers])
        pairs = load_pairs(tmp_path / "whole", name)
        assert len(pairs) == len(numbers) == manifest.data["pairs"][name]
        for index, (pair, want) in enumerate(zip(pairs, wanted, strict=True)):
            assert pair.index == index
            np.testing.assert_array_equal(pair.chosen_ids, want.chosen)
            np.testing.assert_array_equal(pair.rejected_ids, want.rejected)
            for ids, mask in (
                (pair.chosen_ids, pair.chosen_mask),
                (pair.rejected_ids, pair.rejected_mask),
            ):
                assert mask.tolist() == [int(k >= want.prompt_length) for k in range(ids.size)]
        assert pairs.prompt_lengths.tolist() == [w.prompt_length for w in wanted]
        assert pairs.lengths.tolist() == [[w.chosen.size, w.rejected.size] for w in wanted]
        for shard in manifest.split(name)["shards"]:  # a pair never spans two shards
            assert np.fromfile(tmp_path / "whole" / shard["docs"], np.uint32).size % 2 == 0
    assert whole.longest_prompt == max(
        int(load_pairs(tmp_path / "whole", s).prompt_lengths.max()) for s in ("train", "validation")
    )
    # Interrupted after some shards: the rerun (in this process) writes the same files.
    out = tmp_path / "out"
    with interrupted_records(chat_corpus, 40), pytest.raises(KeyboardInterrupt):
        tokenize_preference(corpus, out, tokenizer=tokenizer, shard_tokens=700, workers=1)
    assert (out / PROGRESS_FILE).is_file() and list(out.glob("train-*.mask"))
    again = tokenize_preference(corpus, out, tokenizer=tokenizer, shard_tokens=700, workers=1)
    assert again.corpus.resumed
    for path in sorted((tmp_path / "whole").glob("*-*.*")):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert json.loads((out / "tokens.json").read_text()) == manifest.data
    # Training reads the pairs; supervised fine-tuning refuses them (it would train on the
    # rejected replies).
    loaded = load_corpus(out)
    assert loaded.pairs is not None and len(loaded.pairs[0]) == manifest.data["pairs"]["train"]
    mixture = load_mixture(DataConfig(path=str(out)))
    with pytest.raises(ValueError, match="is a preference corpus"):
        mixture.sampler(64, 0)


def test_bad_preference_input_exits_2_and_writes_nothing(folders, tmp_path):
    good = json.dumps(FORMS["conversation"][0])
    same = {"prompt": TALK[:2], "chosen": TALK[2:3], "rejected": TALK[2:3]}
    cases = {
        "no-rejected.jsonl": (
            json.dumps({"prompt": "a", "chosen": "b"}),
            "no-rejected.jsonl, line 2: the preference record has no 'rejected'",
        ),
        "identical.jsonl": (json.dumps(same), "identical.jsonl, line 2: the chosen and rejected"),
        "mixed.jsonl": (
            json.dumps({"prompt": "a", "chosen": TALK[2:3], "rejected": TALK[2:3]}),
            "mixes texts and lists of messages",
        ),
        "no-prompt.jsonl": (
            json.dumps({"chosen": TALK[2:3], "rejected": TALK[1:2]}),
            "share no first message",
        ),
    }
    runs = [((name, good + "\n" + line), (), text) for name, (line, text) in cases.items()]
    long_prompt = json.dumps({**FORMS["conversation"][0], "prompt": TALK[:4] * 3})
    runs.append(
        (
            ("long.jsonl", good + "\n" + long_prompt),
            ("--seq-len", 100),
            "long.jsonl, line 2: the prompt has",
        )
    )
    for (name, content), options, fragment in runs:
        corpus = tmp_path / name
        corpus.write_text(content + "\n")
        for out in (tmp_path / "out", tmp_path / "empty"):
            out.mkdir(exist_ok=True) if out.name == "empty" else None
            result = invoke("tokenize", corpus, out, "--tokenizer", folders["qwen25"], *options)
            assert result.exit_code == 2 and fragment in result.output, (name, result.output)
            assert "Traceback" not in result.output and len(result.output.split("\n\n")) == 1
            assert not out.exists() if out.name == "out" else not any(out.iterdir())
    # --overlong drop leaves the long prompts out and counts them.
    corpus = tmp_path / "long.jsonl"
    corpus.write_text("\n".join([good] * 6 + [long_prompt] * 3) + "\n")
    out = tmp_path / "dropped"
    result = invoke(
        "tokenize",
        corpus,
        out,
        "--tokenizer",
        folders["qwen25"],
        "--seq-len",
        100,
        "--overlong",
        "drop",
        "--validation-fraction",
        0.3,
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out).data
    assert manifest["dropped_pairs"] == 3 and sum(manifest["pairs"].values()) == 6
    assert "3 pair(s) whose prompt is longer than --seq-len 100 left out" in result.output
    result = invoke("tokenize", tmp_path / "identical.jsonl", tmp_path / "x", "--vocab-size", 300)
    assert result.exit_code == 2 and "holds preference records" in result.output
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(CONVERSATIONS[1]) + "\n")
    result = invoke(
        "tokenize", chat, tmp_path / "x", "--tokenizer", folders["qwen25"], "--overlong", "drop"
    )
    assert result.exit_code == 2 and "--overlong applies to preference records" in result.output
    assert not (tmp_path / "x").exists()
