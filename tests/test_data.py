"""Tests for theseus.data: corpus loading, the stateless sampler and validation batches."""

import json

import numpy as np
import pytest

from theseus.data import Corpus, Sampler, load_corpus, validation_batches, write_tokens
from theseus.data.split import DocumentSplit, split_by_file
from theseus.data.tokens import builtin_files


def arange_tokens(n: int) -> np.ndarray:
    """Tokens equal to their own index, so every window reveals where it came from."""
    return np.arange(n, dtype=np.uint32)


# --- corpora -----------------------------------------------------------------------------


def test_builtin_corpus_splits_stdlib_files():
    corpus = load_corpus(None)
    assert isinstance(corpus, Corpus)
    assert corpus.vocab_size == 256
    assert corpus.train.ndim == corpus.validation.ndim == 1
    assert corpus.train.size > 0 and corpus.validation.size > 0
    assert corpus.train.max() < 256
    assert "built-in" in corpus.source

    root, names = builtin_files()
    train_names, validation_names = split_by_file(names, 0.1, 0)
    assert train_names and validation_names
    assert not set(train_names) & set(validation_names)
    assert sorted(train_names + validation_names) == sorted(names)
    assert corpus.train.size == sum((root / n).stat().st_size for n in train_names)
    assert corpus.validation.size == sum((root / n).stat().st_size for n in validation_names)
    first = np.frombuffer((root / validation_names[0]).read_bytes(), dtype=np.uint8)
    np.testing.assert_array_equal(corpus.validation[: first.size], first)


def test_builtin_corpus_is_deterministic():
    first = load_corpus(None)
    np.testing.assert_array_equal(first.train, load_corpus(None).train)
    np.testing.assert_array_equal(first.validation, load_corpus(None).validation)
    _, names = builtin_files()
    assert split_by_file(names, 0.1, 0) == split_by_file(list(names), 0.1, 0)
    assert split_by_file(names, 0.1, 0) != split_by_file(names, 0.1, 1)


def test_split_by_file_never_leaves_a_split_empty():
    assert split_by_file(["a", "b"], 1e-9, 0)[1]
    assert split_by_file(["a", "b"], 1 - 1e-9, 0)[0]


def test_text_file_tail_split(tmp_path):
    data = bytes(range(256)) * 3 + b"tail" * 11  # 812 bytes
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    corpus = load_corpus(path, validation_fraction=0.25)
    assert corpus.vocab_size == 256
    assert corpus.validation.size == 203
    np.testing.assert_array_equal(
        np.concatenate([corpus.train, corpus.validation]), np.frombuffer(data, np.uint8)
    )


def test_directory_split_by_document(tmp_path):
    """A folder's files are its documents, split by position as theseus.data.split says."""
    contents = {f"sub{i % 3}/file{i:02d}.txt": bytes([i]) * (i + 7) for i in range(29)}
    for name, data in contents.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / ".hidden").write_bytes(b"\xff" * 101)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "objects").write_bytes(b"\xfe" * 103)

    corpus = load_corpus(tmp_path, validation_fraction=0.3)
    split = DocumentSplit(0.3, 0)
    names = sorted(contents)
    validation_names = [n for i, n in enumerate(names) if split.is_validation(i)]
    train_names = [n for n in names if n not in validation_names]
    assert train_names and validation_names
    np.testing.assert_array_equal(
        corpus.train, np.frombuffer(b"".join(contents[n] for n in train_names), np.uint8)
    )
    np.testing.assert_array_equal(
        corpus.validation, np.frombuffer(b"".join(contents[n] for n in validation_names), np.uint8)
    )
    assert "29 file(s)" in corpus.source


def test_directory_with_one_file_falls_back_to_tail_split(tmp_path):
    (tmp_path / "only.txt").write_bytes(b"x" * 97)
    corpus = load_corpus(tmp_path, validation_fraction=0.1)
    assert (corpus.train.size, corpus.validation.size) == (87, 10)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_round_trip(tmp_path, dtype):
    tokens = (np.arange(1009, dtype=np.int64) * 7919) % (70001 if dtype == "uint32" else 65521)
    path = tmp_path / "tokens.bin"
    write_tokens(path, tokens, dtype=dtype)
    corpus = load_corpus(path, validation_fraction=0.1, token_dtype=dtype)
    assert isinstance(corpus.train, np.memmap) and isinstance(corpus.validation, np.memmap)
    assert corpus.train.dtype == np.dtype(dtype)
    assert corpus.validation.size == 101
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.validation]), tokens)
    assert corpus.vocab_size == tokens.max() + 1
    assert load_corpus(path, token_dtype=dtype, vocab_size=80000).vocab_size == 80000


def test_bin_vocab_size_is_read_from_its_sidecar(tmp_path):
    path = tmp_path / "tokens.bin"
    tokens = np.arange(211) % 101
    write_tokens(path, tokens, vocab_size=503)  # the tokenizer's vocabulary, above max + 1
    assert json.loads((tmp_path / "tokens.bin.json").read_text()) == {
        "vocab_size": 503,
        "token_dtype": "uint16",
        "num_tokens": 211,
    }
    assert load_corpus(path).vocab_size == 503  # recorded, not scanned (a scan gives 101)
    (tmp_path / "tokens.bin.json").unlink()
    assert load_corpus(path).vocab_size == 101  # a file from another tool is scanned
    write_tokens(path, tokens)
    tokens[:7].astype("uint16").tofile(path)  # the file changed without its sidecar
    with pytest.raises(ValueError, match=r"tokens\.bin\.json.*211 uint16.*holds 7"):
        load_corpus(path)
    with pytest.raises(ValueError, match="above the largest token 100"):
        write_tokens(path, tokens, vocab_size=100)


def test_corpus_fingerprint_sees_size_and_content(tmp_path):
    tokens = np.arange(40009) % 251
    write_tokens(tmp_path / "a.bin", tokens)
    same = load_corpus(tmp_path / "a.bin").fingerprint()
    assert same == load_corpus(tmp_path / "a.bin").fingerprint()
    tokens[0] = 7  # the first sample block starts at the first token
    write_tokens(tmp_path / "b.bin", tokens)
    assert load_corpus(tmp_path / "b.bin").fingerprint()["sample_crc32"] != same["sample_crc32"]
    write_tokens(tmp_path / "c.bin", tokens[:-1])
    assert load_corpus(tmp_path / "c.bin").fingerprint()["train_tokens"] != same["train_tokens"]


def test_bin_with_partial_token_is_an_error(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 13)
    with pytest.raises(ValueError, match=r"odd\.bin.*13 bytes.*uint16"):
        load_corpus(path)


def test_write_tokens_rejects_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="uint32"):
        write_tokens(tmp_path / "big.bin", np.array([1, 70000]), dtype="uint16")


def test_missing_and_empty_paths_are_named(tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ValueError, match=r"nowhere\.txt"):
        load_corpus(missing)
    empty_file = tmp_path / "empty.txt"
    empty_file.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt"):
        load_corpus(empty_file)
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="emptydir"):
        load_corpus(empty_dir)
    empty_bin = tmp_path / "empty.bin"
    empty_bin.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.bin"):
        load_corpus(empty_bin)


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5])
def test_validation_fraction_outside_unit_interval(tmp_path, fraction):
    path = tmp_path / "c.txt"
    path.write_bytes(b"abc" * 31)
    with pytest.raises(ValueError, match="validation_fraction"):
        load_corpus(path, validation_fraction=fraction)


# --- sampler -----------------------------------------------------------------------------


def test_windows_are_contiguous_slices_with_shifted_targets():
    tokens = (np.arange(1013, dtype=np.int64) * 31 % 251).astype(np.uint16)
    sampler = Sampler(tokens, seq_len=17, seed=3)
    assert sampler.num_windows == 1012 // 17
    batch = sampler.examples(0, 23)
    assert batch.shape == (23, 18) and batch.dtype == np.int32
    index = np.arange(1013)
    positions = Sampler(index, seq_len=17, seed=3).examples(0, 23)
    for example, where in zip(batch, positions, strict=True):
        assert where[0] % 17 == 0
        np.testing.assert_array_equal(where, np.arange(where[0], where[0] + 18))
        np.testing.assert_array_equal(example, tokens[where[0] : where[0] + 18])
        np.testing.assert_array_equal(example[1:], tokens[where[0] + 1 : where[0] + 18])  # targets


def test_sampler_determinism_and_seed():
    tokens = arange_tokens(2003)
    a = Sampler(tokens, 13, seed=5).global_batch(37, 3, 7)
    np.testing.assert_array_equal(a, Sampler(tokens, 13, seed=5).global_batch(37, 3, 7))
    assert not np.array_equal(a, Sampler(tokens, 13, seed=6).global_batch(37, 3, 7))


def test_each_epoch_visits_every_window_once():
    tokens = arange_tokens(1301)
    sampler = Sampler(tokens, 11, seed=2)
    windows = sampler.num_windows  # 118
    starts = sampler.examples(0, 3 * windows)[:, 0] // 11
    for epoch in range(3):
        assert sorted(starts[epoch * windows : (epoch + 1) * windows]) == list(range(windows))
    assert not np.array_equal(starts[:windows], starts[windows : 2 * windows])


def test_batch_spanning_epochs_matches_examples():
    sampler = Sampler(arange_tokens(211), 7, seed=1)  # 30 windows
    batch = sampler.global_batch(19, 5, 3)  # examples 19..33 cross into epoch 1
    assert batch.shape == (5, 3, 8)
    np.testing.assert_array_equal(batch.reshape(15, 8), sampler.examples(19, 15))


def test_local_batch_rows_match_global_batch():
    sampler = Sampler(arange_tokens(3001), 19, seed=4)
    full = sampler.global_batch(101, 3, 11)
    np.testing.assert_array_equal(sampler.local_batch(101, 3, 11, slice(4, 9)), full[:, 4:9])
    rows = np.array([10, 0, 7])
    np.testing.assert_array_equal(sampler.local_batch(101, 3, 11, rows), full[:, rows])
    with pytest.raises(ValueError, match="rows"):
        sampler.local_batch(101, 3, 11, np.array([11]))


def test_local_batch_reads_only_its_rows():
    class CountingTokens(np.ndarray):
        reads = 0

        def __getitem__(self, index):
            CountingTokens.reads += np.size(index)
            return super().__getitem__(index)

    tokens = arange_tokens(5003).view(CountingTokens)
    sampler = Sampler(tokens, 23, seed=0)
    sampler.local_batch(0, 2, 13, slice(0, 3))
    assert CountingTokens.reads == 2 * 3 * 24


def test_position_arithmetic():
    sampler = Sampler(arange_tokens(2999), 7, seed=9)
    first = sampler.global_batch(53, 2, 5)
    second = sampler.global_batch(53 + 2 * 5, 2, 5)
    both = sampler.global_batch(53, 4, 5)
    np.testing.assert_array_equal(np.concatenate([first, second]), both)


def test_too_short_split_is_an_error():
    with pytest.raises(ValueError, match=r"17 tokens.*lower the sequence length"):
        Sampler(arange_tokens(17), 17, seed=0)
    assert Sampler(arange_tokens(17), 16, seed=0).num_windows == 1


# --- validation --------------------------------------------------------------------------


def test_validation_batches_fixed_and_distinct():
    tokens = arange_tokens(4001)
    batches = validation_batches(tokens, 29, num_batches=5, examples_per_batch=7)
    assert batches.shape == (5, 7, 30) and batches.dtype == np.int32
    np.testing.assert_array_equal(batches, validation_batches(tokens, 29, 5, 7))
    starts = batches[:, :, 0].reshape(-1)
    assert len(set(starts.tolist())) == 35  # 137 windows: no window repeats
    training = Sampler(tokens, 29, seed=123)
    training.global_batch(71, 3, 7)  # using a training sampler changes nothing
    np.testing.assert_array_equal(batches, validation_batches(tokens, 29, 5, 7))


def test_validation_batches_wrap_only_when_short():
    tokens = arange_tokens(101)  # 20 windows of seq_len 5
    batches = validation_batches(tokens, 5, num_batches=3, examples_per_batch=7)
    starts = batches[:, :, 0].reshape(-1)
    assert sorted(starts[:20].tolist()) == list(range(0, 100, 5))
    with pytest.raises(ValueError, match=r"has 20 windows.*needs 23"):
        validation_batches(tokens, 5, num_batches=1, examples_per_batch=23)
