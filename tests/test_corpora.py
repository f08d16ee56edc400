"""Corpora at scale: JSON Lines, Parquet and compressed inputs give the same token shards as text;
the split is by document and balanced; every document ends with the end-of-text token; a killed
tokenize resumes to the same files and never trains while unfinished; bad inputs exit 2 having
written nothing; shard folders load as one memory-mapped index space."""

import gzip
import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import TINY_GPT, invoke, subprocess_env

from theseus.data import Sampler, load_corpus
from theseus.data.readers import Piece
from theseus.data.shards import PROGRESS_FILE, ShardedTokens
from theseus.data.split import DocumentSplit
from theseus.tokenization.folder import load_tokenizer
from theseus.tokenization.text import sample_texts, tokenize

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "pi",
]


def documents(count: int, seed: int = 0, *, longest: int = 60) -> list[str]:
    """``count`` documents of 3 to ``longest`` words (some with non-ASCII text and newlines)."""
    rng = random.Random(seed)
    texts = []
    for index in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, longest))]
        if index % 7 == 0:
            words.insert(1, "naïve café\n")
        texts.append(" ".join(words) + f" {index}.\n")
    return texts


def write_jsonl(path, texts, *, field="text"):
    lines = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts))
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(lines.encode()))
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    else:
        path.write_text(lines)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The same 60 documents as a folder of text files, JSON Lines (plain, gzip, zstd, split
    over two files) and Parquet (row groups of 16), and a tokenizer trained on the text."""
    root = tmp_path_factory.mktemp("corpora")
    texts = documents(60)
    text_dir = root / "text"
    text_dir.mkdir()
    for index, text in enumerate(texts):
        (text_dir / f"doc-{index:03d}.txt").write_text(text)
    made = {"text": text_dir}
    for suffix in ("jsonl", "jsonl.gz", "jsonl.zst"):
        folder = root / suffix
        folder.mkdir()
        write_jsonl(folder / f"a.{suffix}", texts[:25])
        write_jsonl(folder / f"b.{suffix}", texts[25:])
        made[suffix] = folder
    made["parquet"] = root / "docs.parquet"
    pq.write_table(pa.table({"text": texts, "n": list(range(60))}), made["parquet"], 16)
    trained = tokenize(text_dir, root / "trained", vocab_size=300, shard_tokens=200)
    assert trained.trained_tokenizer and trained.num_shards > 2
    return texts, made, root / "trained"


def shard_files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*-*.bin"))}


def test_every_format_gives_the_same_token_shards(corpora, tmp_path, monkeypatch):
    _texts, made, trained = corpora
    expected = shard_files(trained)
    manifest = json.loads((trained / "tokens.json").read_text())
    for kind, path in made.items():
        out = tmp_path / kind.replace(".", "-")
        tokenize(path, out, tokenizer=trained / "tokenizer.json", shard_tokens=200)
        assert shard_files(out) == expected, kind
        assert json.loads((out / "tokens.json").read_text())["splits"] == manifest["splits"]
    # several batches, each encoded in several calls of at least ENCODE_MIN_PIECES pieces
    monkeypatch.setattr("theseus.tokenization.streaming.BATCH_BYTES", 2000)
    monkeypatch.setattr("theseus.tokenization.streaming.ENCODE_BYTES", 300)
    out = tmp_path / "small-batches"
    tokenize(made["jsonl"], out, tokenizer=trained / "tokenizer.json", shard_tokens=200)
    assert shard_files(out) == expected


def test_documents_end_with_eos_and_split_as_the_byte_loader(corpora):
    texts, made, trained = corpora
    manifest = json.loads((trained / "tokens.json").read_text())
    tokenizer = load_tokenizer(trained / "tokenizer.json")
    eos = manifest["eos_id"]
    assert tokenizer.id_to_token(eos) == manifest["eos_token"] == "<|endoftext|>"
    split = DocumentSplit(0.1, 0)
    tokens = load_corpus(trained)
    assert isinstance(tokens.train, ShardedTokens)  # several shards, one index space
    for name, split_tokens in (("train", tokens.train), ("validation", tokens.validation)):
        wanted = [t for i, t in enumerate(texts) if split.is_validation(i) == (name != "train")]
        ids = np.asarray(split_tokens).tolist()
        assert ids[-1] == eos
        ends = [i for i, token in enumerate(ids) if token == eos]
        pieces = np.split(np.asarray(ids), np.asarray(ends[:-1]) + 1)
        assert [tokenizer.decode(p.tolist()) for p in pieces] == wanted  # one EOS per document
        assert manifest["splits"][name]["documents"] == len(wanted)
        assert manifest["splits"][name]["bytes"] == sum(len(t.encode()) for t in wanted)
    # The byte loader splits every format by document in the same way.
    for path in made.values():
        byte_corpus = load_corpus(path)
        assert byte_corpus.validation.size == manifest["splits"]["validation"]["bytes"]
        assert byte_corpus.train.size == manifest["splits"]["train"]["bytes"]


def test_split_by_document_is_balanced_seeded_and_keeps_both_sides():
    for fraction in (0.1, 0.05, 0.137):
        split = DocumentSplit(fraction, seed=3)
        chosen = np.array([split.is_validation(i) for i in range(10_007)])
        assert abs(chosen.mean() - fraction) < 0.001
        assert chosen[0] and not chosen[1]  # two documents make both splits
    first = [DocumentSplit(0.1, 0).is_validation(i) for i in range(300)]
    assert first == [DocumentSplit(0.1, 0).is_validation(i) for i in range(300)]
    assert first != [DocumentSplit(0.1, 1).is_validation(i) for i in range(300)]


def test_validation_share_of_ten_thousand_documents(corpora, tmp_path):
    """12,000 documents of 3 to 30 words: the share of documents and of tokens held out is
    within half a percentage point of 10%, and every document ends with the EOS token."""
    _, _, trained = corpora
    corpus = tmp_path / "big.jsonl"
    write_jsonl(corpus, documents(12_000, seed=5, longest=30))
    result = tokenize(corpus, tmp_path / "out", tokenizer=trained / "tokenizer.json")
    documents_share = result.validation_documents / 12_000
    tokens_share = result.validation_tokens / (result.train_tokens + result.validation_tokens)
    assert abs(documents_share - 0.1) < 0.005 and abs(tokens_share - 0.1) < 0.005
    loaded = load_corpus(tmp_path / "out")
    eos = json.loads((tmp_path / "out" / "tokens.json").read_text())["eos_id"]
    for tokens, count in (
        (loaded.train, result.train_documents),
        (loaded.validation, result.validation_documents),
    ):
        assert int(np.count_nonzero(np.asarray(tokens) == eos)) == count and tokens[-1] == eos


KILL_SCRIPT = """
import sys
from theseus.tokenization.text import tokenize
tokenize(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3], shard_tokens=2000, progress=False)
"""


def test_killed_tokenize_resumes_to_the_same_files_and_never_trains_unfinished(corpora, tmp_path):
    _, _, trained = corpora
    corpus = tmp_path / "corpus.jsonl.zst"
    write_jsonl(corpus, documents(4000, seed=9))
    tokenizer = trained / "tokenizer.json"
    whole = tmp_path / "whole"
    tokenize(corpus, whole, tokenizer=tokenizer, shard_tokens=2000, progress=False)
    out = tmp_path / "out"
    command = [sys.executable, "-c", KILL_SCRIPT, corpus, out, tokenizer]
    process = subprocess.Popen([str(c) for c in command], env=subprocess_env())
    deadline = time.time() + 120
    try:
        while time.time() < deadline and process.poll() is None:
            progress = out / PROGRESS_FILE
            if (
                progress.is_file()
                and len(json.loads(progress.read_text())["splits"]["train"]["shards"]) >= 3
            ):
                break
            time.sleep(0.01)
        assert process.poll() is None, "tokenize ended before it could be killed"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    assert not (out / "tokens.json").exists()
    result = invoke("train", f"data.path={out}", *TINY_GPT, "--out", tmp_path / "run")
    assert result.exit_code == 2 and "unfinished" in result.output, result.output
    again = tokenize(corpus, out, tokenizer=tokenizer, shard_tokens=2000, progress=False)
    assert again.resumed
    assert shard_files(out) == shard_files(whole)
    assert not (out / PROGRESS_FILE).exists() and not list(out.glob(".*partial"))
    finished = (out / "tokens.json").read_text()
    assert (
        json.loads(finished)["splits"] == json.loads((whole / "tokens.json").read_text())["splits"]
    )
    assert not tokenize(corpus, out, tokenizer=tokenizer, shard_tokens=2000).resumed  # done


def test_bad_inputs_exit_2_and_write_nothing(corpora, tmp_path):
    _, made, trained = corpora
    tokenizer = trained / "tokenizer.json"
    lacking = tmp_path / "lacking.jsonl"
    write_jsonl(lacking, documents(30), field="body")
    midway = tmp_path / "midway"
    midway.mkdir()
    write_jsonl(midway / "a.jsonl", documents(30))
    (midway / "b.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    broken_gz = tmp_path / "broken.jsonl.gz"
    broken_gz.write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:40])
    broken_zst = tmp_path / "broken.jsonl.zst"
    broken_zst.write_bytes(b"not zstd at all" * 10)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    cases = [
        ((lacking, "--tokenizer", tokenizer), "line 1", tmp_path / "a"),
        ((midway, "--tokenizer", tokenizer), "b.jsonl, line 2", tmp_path / "b"),
        ((made["parquet"], "--text-field", "body", "--tokenizer", tokenizer), "columns", None),
        ((broken_gz, "--tokenizer", tokenizer), "gz-compressed", None),
        ((broken_zst, "--tokenizer", tokenizer), "zst-compressed", None),
        ((made["text"], "--vocab-size", 300), "--overwrite", foreign),
        ((made["text"], "--vocab-size", 300), "--overwrite", run),
        ((made["text"], "--tokenizer", tmp_path / "vocab.json"), "does not exist", None),
    ]
    for args, fragment, out in cases:
        out = out or tmp_path / "out"
        before = sorted(p.name for p in out.iterdir()) if out.exists() else None
        result = invoke("tokenize", args[0], out, *args[1:])
        assert result.exit_code == 2 and fragment in result.output, (args, result.output)
        assert "Traceback" not in result.output
        assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before, args
    assert (foreign / "notes.txt").read_text() == "mine"


def test_shards_are_one_index_space_and_windows_cross_them(tmp_path):
    parts = [np.arange(0, 7), np.arange(7, 20), np.arange(20, 23)]
    for index, part in enumerate(parts):
        part.astype(np.uint16).tofile(tmp_path / f"{index}.bin")
    shards = [np.memmap(tmp_path / f"{i}.bin", np.uint16, mode="r") for i in range(3)]
    tokens = ShardedTokens(shards)
    assert tokens.size == 23 and tokens[5:9].tolist() == [5, 6, 7, 8]
    sampler = Sampler(tokens, 5, seed=0)
    whole = Sampler(np.arange(23, dtype=np.uint16), 5, seed=0)
    np.testing.assert_array_equal(sampler.examples(0, 9), whole.examples(0, 9))
    with pytest.raises(IndexError):
        tokens[np.array([23])]


def test_tokenizer_sample_is_bounded_and_spread_over_the_train_split():
    pieces = [Piece(f"{i:09d}\n", i, 0, True) for i in range(1000)]  # 10 bytes each
    split_of = DocumentSplit(0.1, 0)
    train = [p.text for p in pieces if not split_of.is_validation(p.document)]
    sample = list(
        sample_texts(
            iter(pieces),
            lambda d: "validation" if split_of.is_validation(d) else "train",
            total_bytes=10_000,
            sample_bytes=500,
        )
    )
    assert 400 <= sum(map(len, sample)) <= 500 and set(sample) <= set(train)
    positions = [int(text) for text in sample]
    assert positions[0] < 50 and positions[-1] > 950  # from the start to the end
    assert max(np.diff(positions)) < 40  # evenly, no long gap
