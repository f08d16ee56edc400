"""Online RL's prompts and rewards, as TRL's GRPOTrainer (1.16) reads, encodes, decodes and
scores them: prompt files with their columns and every refusal, reward functions loaded from a
file or a module and called with TRL's keywords, None and weights combined by TRL's formula, the
built-in rewards, and prompt ids and completion texts against transformers' own.

No JAX program runs here; transformers (the reference) comes from tests/hf_reference.py, which
skips without it and fails under CI.
"""

import gzip
import json
import math
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from chat_tokenizers import CONVERSATIONS, tokenizer_folders
from hf_reference import libraries
from tokenizers import Tokenizer, models, pre_tokenizers

from theseus.inference.codec import ByteCodec, TokenizerCodec
from theseus.posttraining.rl.prompts import (
    completion_for,
    decode_completion,
    encode_prompt,
    encode_prompts,
    held_out,
    read_prompts,
    reward_columns,
)
from theseus.posttraining.rl.rewards import (
    RewardError,
    RewardFunction,
    accuracy,
    load_reward,
    score,
    think_format,
)
from theseus.tokenization.folder import TokenizerFolder

ROWS = [
    {"prompt": "2 + 2 =", "answer": "#### 4", "level": 1},
    {"prompt": "Ten times 12?", "answer": "120", "level": 2, "source": "hand"},
]
CHAT = [{"prompt": CONVERSATIONS[0]["messages"][:2], "answer": 7}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer folders of Llama 3, Qwen2.5 and a {% generation %} template."""
    return tokenizer_folders(tmp_path_factory.mktemp("rl-tokenizers"))


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def test_prompt_files_of_every_format_keep_their_columns(tmp_path):
    zst = tmp_path / "p.jsonl.zst"
    zst.write_bytes(
        zstandard.ZstdCompressor().compress(b"".join(json.dumps(r).encode() + b"\n" for r in ROWS))
    )
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "source": r.get("source")} for r in ROWS]), parquet)
    for path in (
        write_jsonl(tmp_path / "p.jsonl", ROWS),
        write_jsonl(tmp_path / "p.jsonl.gz", ROWS, gzip.open),
        zst,
    ):
        records = read_prompts(path)
        assert [r.prompt for r in records] == ["2 + 2 =", "Ten times 12?"]
        assert [r.columns for r in records] == [
            {k: v for k, v in r.items() if k != "prompt"} for r in ROWS
        ]
        assert [r.index for r in records] == [0, 1] and records[1].where.endswith("line 2")
        # TRL's columns: a field a record lacks is None, as a dataset read from JSON Lines holds it
        assert reward_columns(records) == {
            "answer": ["#### 4", "120"],
            "level": [1, 2],
            "source": [None, "hand"],
        }
    records = read_prompts(parquet)
    assert [r.columns["source"] for r in records] == [None, "hand"]
    (tmp_path / "chat").mkdir()  # a folder: its files in sorted order
    write_jsonl(tmp_path / "chat" / "b.jsonl", CHAT)
    write_jsonl(tmp_path / "chat" / "a.jsonl", CHAT * 2)
    chat = read_prompts(tmp_path / "chat")
    assert [r.where.split("/")[-1] for r in chat] == [
        "a.jsonl, line 1",
        "a.jsonl, line 2",
        "b.jsonl, line 1",
    ]
    assert chat[0].conversational and chat[0].prompt == CHAT[0]["prompt"]
    assert completion_for(chat[0], "7") == [{"role": "assistant", "content": "7"}]
    assert completion_for(records[0], "4") == "4"
    # TRL passes neither the prompt nor a completion column to reward functions
    with_completion = [{"prompt": "a", "completion": "b", "completion_ids": [1], "x": 1}]
    assert reward_columns(read_prompts(write_jsonl(tmp_path / "c.jsonl", with_completion))) == {
        "x": [1]
    }


def test_bad_prompt_files_are_refused_naming_what_and_where(tmp_path):
    def refused(rows_or_path, *words):
        path = (
            rows_or_path
            if not isinstance(rows_or_path, list)
            else write_jsonl(tmp_path / f"bad{len(list(tmp_path.iterdir()))}.jsonl", rows_or_path)
        )
        with pytest.raises(ValueError) as error:
            read_prompts(path)
        for word in words:
            assert word in str(error.value), (word, str(error.value))

    refused(tmp_path / "missing.jsonl", "missing.jsonl", "does not exist")
    refused(
        [ROWS[0], {"question": "q", "answer": "1"}],
        "line 2",
        "record 1",
        "'question'",
        "'answer'",
        "no 'prompt'",
    )
    refused([{"prompt": 12}], "record 0", "int", "neither text nor")
    refused([{"prompt": [{"role": "user"}]}], "record 0", "lacks 'content'")
    refused([ROWS[0], *CHAT], "two kinds", "record 0", "record 1", "text", "a conversation")
    (tmp_path / "empty.jsonl").write_text("")
    refused(tmp_path / "empty.jsonl", "empty.jsonl", "holds no records")
    (tmp_path / "notes.txt").write_text("hello")
    refused(tmp_path / "notes.txt", "notes.txt", "neither JSON Lines nor Parquet")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    refused(tmp_path / "broken.jsonl", "broken.jsonl", "line 2", "not valid JSON")


def test_held_out_prompts_are_seeded_exact_and_never_empty():
    split = held_out(100, 0.1, 3)
    assert len(split.validation) == 10 and len(split.train) == 90
    assert sorted([*split.train, *split.validation]) == list(range(100))
    assert np.array_equal(split.validation, held_out(100, 0.1, 3).validation)
    assert not np.array_equal(split.validation, held_out(100, 0.1, 4).validation)
    assert len(held_out(10, 0.01, 0).validation) == 1  # a positive fraction holds one out
    assert len(held_out(2, 0.9, 0).train) == 1  # and leaves one to train
    assert len(held_out(5, 0.0, 0).validation) == 0 and len(held_out(5, 0.0, 0).train) == 5
    assert len(held_out(10, 0.25, 0).validation) == 3  # 2.5 rounds up
    with pytest.raises(ValueError, match="none to train on"):
        held_out(1, 0.5, 0)
    with pytest.raises(ValueError, match="at least 0 and below 1"):
        held_out(10, 1.0, 0)


REWARD_FILE = """
import helper

def length_reward(prompts, completions, completion_ids, answer, **kwargs):
    return [float(len(c)) * helper.SCALE for c in completions]

def not_a_function_yet():
    return 1

CONSTANT = 3
"""


def test_rewards_load_from_a_file_or_a_module_and_bad_specs_say_why(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(REWARD_FILE)
    (tmp_path / "rewards" / "helper.py").write_text("SCALE = 2.0\n")  # beside the file
    loaded = load_reward("rewards/mine.py:length_reward")
    assert loaded.name == "length_reward"
    assert loaded.fn(prompts=["p"], completions=["abc"], completion_ids=[[1]], answer=[1]) == [6.0]
    builtin = load_reward("theseus.posttraining.rl.rewards:accuracy")
    assert builtin == RewardFunction("accuracy", accuracy)
    assert load_reward("theseus.posttraining.rl.rewards:think_format").name == "think_format"

    def refused(spec, *words):
        with pytest.raises(ValueError) as error:
            load_reward(spec)
        for word in [repr(spec), *words]:
            assert word in str(error.value), (word, str(error.value))

    refused("rewards/mine.py", "names no function")
    refused("rewards/absent.py:f", "does not exist", str(tmp_path))
    refused("rewards/mine.py:missing", "no 'missing'", "length_reward", "not_a_function_yet")
    refused("rewards/mine.py:CONSTANT", "holds int 3, not a function")
    (tmp_path / "rewards" / "broken.py").write_text("def f(:\n")
    refused("rewards/broken.py:f", "cannot be imported", "SyntaxError")
    (tmp_path / "rewards" / "raising.py").write_text("raise RuntimeError('no GPU here')\n")
    refused("rewards/raising.py:f", "cannot be imported", "RuntimeError: no GPU here")
    refused("no_such_package.rewards:f", "cannot be imported", "ModuleNotFoundError")
    # the current directory is searched for a module spec, as TRL's command line does
    (tmp_path / "local_rewards.py").write_text(
        "def one(completions, **kwargs):\n    return [1.0]*len(completions)\n"
    )
    assert load_reward("local_rewards:one").name == "one"


def test_reward_functions_receive_trls_keywords():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            answer=answer,
            **kwargs,
        )
        kwargs["log_metric"]("spy/calls", 2.0)
        kwargs["log_metric"]("spy/calls", 4.0)
        kwargs["log_extra"]("spy_note", ["a", "b"])
        return [0.5, None]

    prompts = ["2 + 2 =", "2 + 2 ="]
    scores = score(
        [RewardFunction.of(spy)],
        None,
        prompts=prompts,
        completions=["4", "5"],
        completion_ids=[[52], [53]],
        columns={"answer": ["4", "4"], "level": [1, 1]},
        step=7,
    )
    assert seen["prompts"] == prompts and seen["completions"] == ["4", "5"]
    assert seen["completion_ids"] == [[52], [53]] and seen["answer"] == ["4", "4"]
    assert seen["level"] == [1, 1] and seen["trainer_state"].global_step == 7
    assert set(seen) == {
        "prompts",
        "completions",
        "completion_ids",
        "answer",
        "level",
        "trainer_state",
        "log_extra",
        "log_metric",
    }
    assert scores.logged == {"spy/calls": 3.0} and scores.extra == {"spy_note": ["a", "b"]}
    assert scores.metrics()["spy/calls"] == 3.0
    np.testing.assert_array_equal(scores.per_function["spy"], [0.5, np.nan])


def test_none_and_weights_combine_as_trls_formula():
    """TRL: rewards (N, F) float32 with None as NaN; total = nansum(rewards * weights, axis=1),
    NaN where every function returned None; metrics nanmean and Bessel-corrected nanstd."""
    a = RewardFunction("a", lambda completions, **kw: [1.0, None, 0.0, None])
    b = RewardFunction("b", lambda completions, **kw: [0.5, 2, None, None])
    c = RewardFunction("c", lambda completions, **kw: [True, -1.5, 3, None])
    scores = score(
        [a, b, c],
        [2.0, -1.0, 0.25],
        prompts=["p"] * 4,
        completions=["x"] * 4,
        completion_ids=[[1]] * 4,
        columns={},
        step=0,
    )
    # by hand: row 0 = 2*1 - 0.5 + 0.25*1, row 1 = -2 + 0.25*-1.5, row 2 = 0 + 0.25*3, row 3: NaN
    np.testing.assert_array_equal(scores.total, np.float32([1.75, -2.375, 0.75, np.nan]))
    assert scores.total.dtype == np.float32
    metrics = scores.metrics()
    assert metrics["rewards/a/mean"] == 0.5 and metrics["rewards/b/mean"] == 1.25
    assert math.isclose(metrics["rewards/a/std"], math.sqrt(0.5), rel_tol=1e-6)  # ddof 1
    assert math.isclose(metrics["rewards/b/std"], math.sqrt(1.125), rel_tol=1e-6)
    assert math.isclose(metrics["rewards/c/mean"], 2.5 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["reward"], (1.75 - 2.375 + 0.75) / 3, rel_tol=1e-6)
    assert math.isclose(
        metrics["reward_std"], float(np.std([1.75, -2.375, 0.75], ddof=1)), rel_tol=1e-6
    )
    lone = score(
        [RewardFunction("a", lambda completions, **kw: [1.0, None])],
        None,
        prompts=["p"] * 2,
        completions=["x"] * 2,
        completion_ids=[[1]] * 2,
        columns={},
        step=0,
    )
    assert lone.metrics()["rewards/a/mean"] == 1.0 and math.isnan(lone.metrics()["rewards/a/std"])


def test_bad_reward_functions_and_inputs_are_named(tmp_path):
    def failing(completions, **kwargs):
        raise KeyError("answer")

    def call(fn, **changes):
        inputs = dict(
            prompts=["p", "q"],
            completions=["x", "y"],
            completion_ids=[[1], [2]],
            columns={},
            step=12,
        )
        return score([RewardFunction.of(fn)], None, **(inputs | changes))

    cases = [
        (failing, ["'failing'", "KeyError", "step 12", "'answer'"]),
        (lambda **kw: [1.0], ["'<lambda>'", "1 rewards for 2 completions", "step 12"]),
        (lambda **kw: [1.0, "1"], ["str '1' for completion 1", "step 12"]),
        (lambda **kw: {"x": 1}, ["dict {'x': 1}", "a list of 2 rewards"]),
        (lambda **kw: "y" * 200, ["str 'yyy", "..."]),
    ]
    for fn, words in cases:
        with pytest.raises(RewardError) as error:
            call(fn)
        assert all(w in str(error.value) for w in words), (words, str(error.value))

    async def judged(completions, **kwargs):
        return [float(len(c)) for c in completions]

    assert call(judged).total.tolist() == [1.0, 1.0]
    one = RewardFunction("one", lambda **kw: [1.0, 1.0])
    for changes, words in (
        (dict(functions=[one, one]), ["'one'", "collide"]),
        (dict(weights=[1.0, 2.0]), ["2 reward weights for 1"]),
        (dict(completions=["x"]), ["2 prompts but 1 completions"]),
        (dict(columns={"answer": [1]}), ["1 column 'answer'"]),
        (dict(columns={"completions": [1, 2]}), ["'completions'", "rename"]),
    ):
        inputs = (
            dict(
                functions=[one],
                weights=None,
                prompts=["p", "q"],
                completions=["x", "y"],
                completion_ids=[[1], [2]],
                columns={},
                step=0,
            )
            | changes
        )
        with pytest.raises(ValueError) as error:
            score(inputs.pop("functions"), inputs.pop("weights"), **inputs)
        assert all(w in str(error.value) for w in words), (words, str(error.value))


def test_accuracy_compares_final_numbers_and_think_format_wants_an_answer():
    completions = [
        "3 + 4 = 7. The answer is 42.",  # GSM8K gold
        "Between 1 and 3: \\boxed{2} (not 3)",  # the boxed answer wins over the last number
        "It drops to -5 degrees",
        "That is 3.0",
        "About 1,234 apples",
        "I cannot say",
        "whatever 9",
        [{"role": "assistant", "content": "so \\boxed{\\frac{1}{2}} = 0.5"}],
        "the total is 17",
        "42",
    ]
    answers = [
        "Natalia sold 6 * 7 = 42.\n#### 42",
        "\\boxed{2}",
        "-5",
        3,
        "1234",
        "12",
        None,
        0.5,
        "seventeen",
        "#### 1,000",
    ]
    assert accuracy(completions, answers, level=[1] * 10) == [
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.0,
        None,
        0.0,
        None,
        0.0,
    ]
    # the boxed \frac{1}{2} has the last number 2, not 0.5: boxed content is the answer
    assert accuracy(["\\boxed{1,000}", "-0.50"], ["#### 1,000", "-.5"]) == [1.0, 1.0]
    formats = [
        "<think>\nsteps\n</think>\n42",
        "<think>steps</think>42",
        "<think>\nsteps\n</think>\n",  # no answer after the block
        "steps</think> 42",  # no opening tag
        " <think>x</think> 42",  # not at the start
        "<think>a<think>b</think> 42",  # a second opening tag (TRL's rule)
        [{"role": "assistant", "content": "<think>ok</think> yes"}],
    ]
    assert think_format(formats, answer=[None] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_prompt_ids_and_completion_texts_equal_transformers(folders, tmp_path):
    transformers = libraries().transformers
    chat = read_prompts(
        write_jsonl(
            tmp_path / "chat.jsonl",
            [
                {"prompt": CONVERSATIONS[0]["messages"][:2]},
                {"prompt": CONVERSATIONS[0]["messages"][:4]},
                {"prompt": CONVERSATIONS[1]["messages"][:1]},
            ],
        )
    )
    text = read_prompts(
        write_jsonl(
            tmp_path / "text.jsonl",
            [{"prompt": "  What is a naïve café? 😀 "}, {"prompt": "<|im_start|>user\nhi"}],
        )
    )
    flagged = tmp_path / "flagged"  # flags transformers 5 drops beside tokenizer.json
    shutil.copytree(folders["qwen25"], flagged)
    config = json.loads((flagged / "tokenizer_config.json").read_text())
    config |= {
        "bos_token": "<|endoftext|>",
        "add_bos_token": True,
        "add_eos_token": True,
        "clean_up_tokenization_spaces": True,
    }  # which a BPE's decoding ignores
    (flagged / "tokenizer_config.json").write_text(json.dumps(config))
    for name, path in [*folders.items(), ("flagged", flagged)]:
        folder = TokenizerFolder.at(path)
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(path)
        for record in chat:
            wanted = hf.apply_chat_template(
                record.prompt, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            assert encode_prompt(record, folder) == wanted, (name, record.index)
        mine = encode_prompts(text, TokenizerCodec(folder))
        assert mine == [hf(r.prompt)["input_ids"] for r in text], name
        special = [folder.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|eot_id|>")]
        for ids in (
            mine[0] + [folder.eos_ids[0]],
            special + mine[1] + special,
            hf("a , b . c ?")["input_ids"],
        ):
            assert (
                decode_completion(ids, folder)
                == hf.batch_decode([ids], skip_special_tokens=True)[0]
            ), name
    plain = encode_prompt(text[0], TokenizerFolder.at(folders["qwen25"]))
    assert encode_prompt(text[0], TokenizerFolder.at(flagged)) == plain
    words = tmp_path / "words"  # a WordLevel model: transformers cleans up its spaces
    words.mkdir()
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", ",", "world", ".", "</s>"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(words / "tokenizer.json"))
    (words / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "</s>",
                "clean_up_tokenization_spaces": True,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(words)
    ids = [1, 2, 3, 4, 5]
    assert (
        decode_completion(ids, TokenizerFolder.at(words))
        == hf.batch_decode([ids], skip_special_tokens=True)[0]
        == "hello, world."
    )


def test_without_a_tokenizer_text_is_bytes_and_conversations_are_refused(folders, tmp_path):
    text = read_prompts(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "né"}]))
    assert encode_prompt(text[0], ByteCodec()) == [110, 195, 169]
    assert decode_completion([110, 195, 169, 300], ByteCodec(vocab_size=512)) == "né⟨300⟩"
    chat = read_prompts(write_jsonl(tmp_path / "c.jsonl", CHAT))
    with pytest.raises(
        ValueError,
        match=r"c\.jsonl, line 1: the prompt is a conversation.*"
        r"no tokenizer \(its text is UTF-8 bytes\)",
    ):
        encode_prompt(chat[0], ByteCodec())
    plain = tmp_path / "plain"
    shutil.copytree(folders["qwen25"], plain)
    (plain / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="has no chat template"):
        encode_prompts([*chat, *chat], TokenizerFolder.at(plain))
