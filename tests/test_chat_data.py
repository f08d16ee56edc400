"""Chat data: conversations rendered and encoded as transformers' ``apply_chat_template`` does,
loss masks equal to its ``assistant_masks`` ({% generation %}) or to prefix rendering, shards and
masks streamed and resumed and loaded for training, bad input refused.

Tiny byte-level BPE tokenizers (tests/chat_tokenizers.py) carry the chat templates of Llama 3,
Qwen2.5 (ChatML, a default system prompt, tools) and a ChatML template with {% generation %} blocks.
"""

import gzip
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_tokenizers import CONVERSATIONS, tokenizer_folders
from hf_reference import libraries
from support import interrupted_records, invoke, lm_eval_module
from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors

import theseus.tokenization.chat.corpus as chat_tokenize
from theseus.data import load_corpus
from theseus.data.shards import (
    PROGRESS_FILE,
    example_lengths,
    open_masks,
    open_split,
    read_manifest,
)
from theseus.data.split import DocumentSplit
from theseus.tokenization.chat.encoder import ByteSpelling, ChatEncoder, Example
from theseus.tokenization.chat.records import parse_record


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer folders of Llama 3, Qwen2.5 and a {% generation %} template."""
    return tokenizer_folders(tmp_path_factory.mktemp("chat-tokenizers"))


def _prefix_mask(hf, messages, tools, ids) -> np.ndarray:
    """transformers' ids of the conversation up to each assistant turn (with the generation
    prompt) and through it: the tokens between train, but trailing whitespace tokens."""
    mask = np.zeros(len(ids), np.uint8)

    def encoded(part, prompt):
        out = hf.apply_chat_template(part, tools=tools, add_generation_prompt=prompt)
        assert ids[: len(out["input_ids"])] == out["input_ids"]
        return len(out["input_ids"])

    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = encoded(messages[:index], True), encoded(messages[: index + 1], False)
            while end > start and not hf.decode(ids[end - 1 : end]).strip():
                end -= 1
            mask[start:end] = 1
    return mask


def test_ids_and_masks_equal_transformers(folders):
    transformers = libraries().transformers
    for name, folder in folders.items():
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
        encoder = ChatEncoder.from_folder(folder)
        for number, raw in enumerate(CONVERSATIONS):
            messages, tools = raw["messages"], raw.get("tools")
            if name == "llama3" and tools:
                continue  # Llama 3's template has no tool calls
            mine = encoder.encode_record(parse_record(raw, 0, "test"))
            theirs = hf.apply_chat_template(
                messages, tools=tools, return_assistant_tokens_mask=name == "generation"
            )
            assert mine.ids.tolist() == theirs["input_ids"], (name, number)
            if name == "generation":
                wanted = np.asarray(theirs["assistant_masks"], np.uint8)
            else:
                wanted = _prefix_mask(hf, messages, tools, theirs["input_ids"])
            np.testing.assert_array_equal(mine.mask, wanted, err_msg=f"{name} {number}")
            assert wanted.sum() > 0
    llama = ChatEncoder.from_folder(folders["llama3"])
    ids = llama.encode_record(parse_record(CONVERSATIONS[0], 0, "test")).ids
    assert (ids == llama.tokenizer.token_to_id("<|begin_of_text|>")).sum() == 1  # no second BOS


def test_masks_from_the_bytes_tokens_spell_equal_masks_from_the_library_offsets(folders):
    """Byte-level tokenizers are masked from the bytes each id spells (ByteSpelling, no
    offsets from the library): on texts of 1 to 4 byte characters, special tokens and
    whitespace, with random spans, the masks equal the overlap rule on the library's own
    offsets; a text NFC changes takes the library's offsets; layouts whose tokens do not spell
    the text (trimmed offsets, an added token that strips whitespace) are not spelled."""
    rng = np.random.default_rng(0)
    pieces = ["a", "café", "e\u0301", " ", "\n\n", "😀", "数据", "ß", "<|im_end|>", "x1", "  q"]
    texts = ["".join(rng.choice(pieces, size=rng.integers(1, 40))) for _ in range(60)]
    for name in ("llama3", "qwen25", "generation"):
        encoder = ChatEncoder.from_folder(folders[name])
        assert encoder.spelling is not None and encoder.spelling.nfc == (name == "qwen25")
        examples = []
        for number, text in enumerate(texts):
            cuts = np.sort(rng.choice(len(text), size=3, replace=True)).tolist()
            spans = ((cuts[0], cuts[1]), (cuts[2], len(text)))  # the first may be empty
            examples.append(Example(number, text, spans, False, f"text {number}"))
        for example, mine in zip(examples, encoder.encode(examples), strict=True):
            library = encoder.tokenizer.encode(example.text, add_special_tokens=False)
            assert mine.ids.tolist() == library.ids
            wanted = [
                int(any(end > a and start < b for a, b in example.spans if b > a))
                or int(any(a == b and start < a < end for a, b in example.spans))
                for start, end in library.offsets
            ]
            assert mine.mask.tolist() == wanted, (name, example.text, example.spans)
    qwen = ChatEncoder.from_folder(folders["qwen25"]).spelling
    assert 0 < sum(map(qwen.spells, texts)) < len(texts)  # the library's offsets for the rest
    trimmed = Tokenizer.from_str(encoder.tokenizer.to_str())
    trimmed.post_processor = processors.ByteLevel(trim_offsets=True)
    stripping = Tokenizer.from_str(encoder.tokenizer.to_str())
    stripping.add_special_tokens([AddedToken("<|tool|>", lstrip=True)])
    metaspace = Tokenizer.from_str(encoder.tokenizer.to_str())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    assert [ByteSpelling.of(t) for t in (trimmed, stripping, metaspace)] == [None] * 3


def test_prompt_completion_trains_the_completion_only(folders):
    hf = libraries().transformers.PreTrainedTokenizerFast.from_pretrained(folders["llama3"])
    encoder = ChatEncoder.from_folder(folders["llama3"])
    record = {"prompt": "Translate: café →", "completion": " coffee shop"}
    mine = encoder.encode_record(parse_record(record, 0, "test"))
    prompt_ids = hf(record["prompt"])["input_ids"]  # begins with <|begin_of_text|>
    assert mine.ids.tolist() == hf(record["prompt"] + record["completion"])["input_ids"] + [
        encoder.eos_id
    ]
    assert mine.mask[: len(prompt_ids) - 1].sum() == 0 and mine.mask[-1] == 1
    assert hf.decode(mine.ids[mine.mask == 1]) == " coffee shop<|eot_id|>"
    conversational = {
        "prompt": CONVERSATIONS[0]["messages"][:4],
        "completion": CONVERSATIONS[0]["messages"][4:],
    }
    both = ChatEncoder.from_folder(folders["qwen25"]).encode_record(
        parse_record(conversational, 0, "test")
    )
    whole = ChatEncoder.from_folder(folders["qwen25"]).encode_record(
        parse_record(CONVERSATIONS[0], 0, "test")
    )
    np.testing.assert_array_equal(both.ids, whole.ids)
    last = np.flatnonzero(whole.mask)
    assert both.mask.sum() < whole.mask.sum() and both.mask[last[-1]] == 1
    assert hf.decode(both.ids[both.mask == 1]) == "The fourth letter, after gamma.<|im_end|>"


# generation_config.json as Llama 3.1 Instruct, Llama 3 (base) and Qwen2.5 Instruct publish it,
# their ids those of the same tokens here; None: the folder has none (the tokenizer's eos ends).
GENERATION_CONFIGS = {
    "llama3-instruct": (
        "llama3",
        {
            "bos_token_id": "<|begin_of_text|>",
            "eos_token_id": ["<|end_of_text|>", "<|eot_id|>"],
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.9,
        },
    ),
    "llama3-base": (
        "llama3",
        {
            "bos_token_id": "<|begin_of_text|>",
            "eos_token_id": ("<|end_of_text|>"),
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.9,
        },
    ),
    "qwen25-instruct": (
        "qwen25",
        {
            "bos_token_id": "<|endoftext|>",
            "pad_token_id": ("<|endoftext|>"),
            "do_sample": True,
            "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
            "repetition_penalty": 1.05,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
        },
    ),
    "generation": ("generation", None),
}


def test_end_of_sequence_ids_equal_transformers(folders, tmp_path):
    """Chat generation, the evaluation harness and the codec of ``theseus generate`` end on the
    ids transformers' generate stops on (GenerationConfig's eos_token_id, an id or a list),
    else, for a folder without generation_config.json, its tokenizer's eos_token_id: for run
    folders holding tokenizer files laid out as Llama 3's and Qwen2.5's are published."""
    transformers = libraries().transformers
    lm_eval_module()  # the harness's module builds on lm_eval
    from theseus.inference.chat import chat_folder
    from theseus.inference.codec import resolve_codec
    from theseus.inference.harness import find_tokenizer

    for name, (base, generation) in GENERATION_CONFIGS.items():
        run = tmp_path / name
        shutil.copytree(folders[base], run)
        tokenizer = Tokenizer.from_file(str(run / "tokenizer.json"))
        if generation is not None:
            ids = {
                key: [tokenizer.token_to_id(t) for t in value]
                if isinstance(value, list)
                else tokenizer.token_to_id(value)
                for key, value in generation.items()
                if key.endswith("token_id")
            }
            (run / "generation_config.json").write_text(json.dumps({**generation, **ids}))
            wanted = transformers.GenerationConfig.from_pretrained(run).eos_token_id
        else:
            wanted = transformers.PreTrainedTokenizerFast.from_pretrained(run).eos_token_id
        wanted = wanted if isinstance(wanted, list) else [wanted]
        assert len(wanted) == (2 if name.endswith("instruct") else 1), name
        codec = resolve_codec([run], None, None, tokenizer.get_vocab_size())
        got = {
            "chat": chat_folder(run, None).eos_ids,
            "harness": find_tokenizer([run], None).eos_ids,
            "codec": codec.eos_ids,
        }
        assert got == dict.fromkeys(got, tuple(wanted)), name
    # A run keeps only the tokenizer.json of the tokenized folder it trained on: all three find
    # the folder with its configuration.
    run, data = tmp_path / "trained-on-chat", tmp_path / "qwen25-instruct"
    run.mkdir()
    shutil.copyfile(data / "tokenizer.json", run / "tokenizer.json")
    (run / "config.yaml").write_text(f"data:\n  path: {data}\n")
    found = [
        chat_folder(run, None).path,
        find_tokenizer([run], str(data)).folder.path,
        resolve_codec([run], None, str(data), 400).folder.path,
    ]
    assert found == [data] * 3


def _records(count: int) -> list[dict]:
    records = []
    for index in range(count):
        raw = json.loads(json.dumps(CONVERSATIONS[index % len(CONVERSATIONS)]))
        raw["messages"][-1]["content"] += f" ({index})" * (1 + index % 5)
        records.append(raw)
    return records


def _write_corpus(folder, records) -> None:
    folder.mkdir()
    half = len(records) // 2
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[:half])
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    # Parquet holds the messages as a list of structs (the records without tool calls)
    table = pa.Table.from_pylist(
        [{"messages": r["messages"]} for r in records[half:] if "tools" not in r]
    )
    pq.write_table(table, folder / "b.parquet", row_group_size=7)


def test_shards_and_masks_stream_resume_and_load_for_training(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(
        "theseus.tokenization.streaming.BATCH_BYTES", 2000
    )  # several batches, as large corpora
    records = _records(90)
    corpus = tmp_path / "chats"
    _write_corpus(corpus, records)
    half = len(records) // 2
    read = records[:half] + [r for r in records[half:] if "tools" not in r]
    tokenizer = folders["qwen25"]
    whole = chat_tokenize.tokenize_chat(  # encoded by 2 worker processes
        corpus, tmp_path / "whole", tokenizer=tokenizer, shard_tokens=900, workers=2
    )
    encoder = ChatEncoder.from_folder(tokenizer)
    split = DocumentSplit(0.1, 0)
    manifest = read_manifest(tmp_path / "whole")
    assert manifest.data["loss_mask"] and whole.corpus.num_shards > 4
    for name in ("train", "validation"):
        chosen = [
            encoder.encode_record(parse_record(raw, document, "test"))
            for document, raw in enumerate(read)
            if split.is_validation(document) == (name == "validation")
        ]
        tokens = np.asarray(open_split(tmp_path / "whole", manifest, name))
        masks = np.asarray(open_masks(tmp_path / "whole", manifest, name))
        np.testing.assert_array_equal(tokens, np.concatenate([e.ids for e in chosen]))
        np.testing.assert_array_equal(masks, np.concatenate([e.mask for e in chosen]))
        assert manifest.split(name)["trained_tokens"] == int(masks.sum())
        lengths = example_lengths(tmp_path / "whole", manifest, name)
        assert lengths.tolist() == [e.ids.size for e in chosen]
    # Interrupted after some shards: the rerun (encoding in this process) resumes to the same
    # files as the workers wrote.
    out = tmp_path / "out"
    with interrupted_records(chat_tokenize, 60), pytest.raises(KeyboardInterrupt):
        chat_tokenize.tokenize_chat(corpus, out, tokenizer=tokenizer, shard_tokens=900, workers=2)
    assert (out / PROGRESS_FILE).is_file() and list(out.glob("train-*.mask"))
    again = chat_tokenize.tokenize_chat(
        corpus, out, tokenizer=tokenizer, shard_tokens=900, workers=1
    )
    assert again.corpus.resumed
    for path in sorted((tmp_path / "whole").glob("*-*.*")):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert json.loads((out / "tokens.json").read_text())["splits"] == manifest.data["splits"]
    # --seq-len: the train split packed as training packs it (its longest conversations cut).
    train_lengths = example_lengths(out, manifest, "train")
    row_tokens = int(np.median(train_lengths)) * 2  # seq_len + 1: about two per row
    packed = chat_tokenize.tokenize_chat(
        corpus, out, tokenizer=tokenizer, shard_tokens=900, seq_len=row_tokens - 1
    ).packing
    kept = np.minimum(train_lengths, row_tokens)
    assert packed.row_tokens == row_tokens and packed.kept.sum() == kept.sum()
    assert packed.truncated == int((train_lengths > row_tokens).sum()) > 0
    assert packed.efficiency == kept.sum() / (packed.num_rows * row_tokens) > 0.5
    assert packed.num_rows < len(train_lengths)
    # Training reads the tokens, masks and example lengths (tests/test_packing.py trains them).
    loaded = load_corpus(out).examples[0]
    np.testing.assert_array_equal(loaded.lengths, example_lengths(out, manifest, "train"))
    np.testing.assert_array_equal(np.asarray(loaded.mask), open_masks(out, manifest, "train"))


def test_bad_chat_input_exits_2_and_writes_nothing(folders, tmp_path):
    good = json.dumps(CONVERSATIONS[1])
    cases = {
        "no-messages.jsonl": ('{"text": "plain"}', "no 'messages' field"),
        "no-content.jsonl": ('{"messages": [{"role": "user"}]}', "lacks 'content'"),
        "no-role.jsonl": ('{"messages": [{"content": "hi"}]}', "lacks 'role'"),
        "rejected.jsonl": (
            '{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
            "rejected.jsonl, line 2: the chat template raised an error: role robot is not one",
        ),
        "untrained.jsonl": (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            "no token to train",
        ),
    }
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((folders["generation"] / "tokenizer.json").read_bytes())
    (bare / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    runs = [
        ((name, good + "\n" + line), folders["generation"], text)
        for name, (line, text) in cases.items()
    ]
    runs.append((("plain.jsonl", good), bare, "has no chat template"))
    for (name, content), tokenizer, fragment in runs:
        corpus = tmp_path / name
        corpus.write_text(content + "\n")
        for out in (tmp_path / "out", tmp_path / "empty"):
            out.mkdir(exist_ok=True) if out.name == "empty" else None
            result = invoke("tokenize", corpus, out, "--tokenizer", tokenizer, "--shard-tokens", 10)
            assert result.exit_code == 2 and fragment in result.output, (name, result.output)
            assert "Traceback" not in result.output and len(result.output.split("\n\n")) == 1
            assert not out.exists() if out.name == "out" else not any(out.iterdir())
    table = pa.Table.from_pylist([{"messages": CONVERSATIONS[1]["messages"]}, {"messages": None}])
    pq.write_table(table, tmp_path / "holes.parquet")
    result = invoke(
        "tokenize", tmp_path / "holes.parquet", tmp_path / "out", "--tokenizer", folders["qwen25"]
    )
    assert result.exit_code == 2 and "holes.parquet, row group 0, row 1" in result.output
    assert not (tmp_path / "out").exists()
    template = tmp_path / "raises.jinja"
    template.write_text("{{ raise_exception('this template refuses everything') }}")
    corpus = tmp_path / "plain.jsonl"
    result = invoke(
        "tokenize",
        corpus,
        tmp_path / "out",
        "--tokenizer",
        folders["generation"],
        "--chat-template",
        template,
    )
    assert result.exit_code == 2 and "this template refuses everything" in result.output
    result = invoke("tokenize", corpus, tmp_path / "out", "--vocab-size", 300)
    assert result.exit_code == 2 and "tokenizer folder" in result.output
    (tmp_path / "text.txt").write_text("plain text, no records\n")
    result = invoke("tokenize", tmp_path / "text.txt", tmp_path / "out", "--seq-len", 8)
    assert (
        result.exit_code == 2
        and "--seq-len applies to chat and preference records" in result.output
    )
    assert not (tmp_path / "out").exists()
    # A bad record met by a worker process: the same paragraph, nothing written.
    corpus.write_text("\n".join([good] * 40 + ['{"messages": [}'] + [good] * 5) + "\n")
    with pytest.raises(ValueError, match=r"plain.jsonl, line 41, is not valid JSON"):
        chat_tokenize.tokenize_chat(
            corpus, tmp_path / "out", tokenizer=folders["generation"], workers=2
        )
    assert not (tmp_path / "out").exists()
