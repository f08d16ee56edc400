"""Tokenize and generate: the BPE folder round-trips and trains; cached greedy decoding equals the
argmax of full forward passes; every layout gives the same completions; bad input exits 2."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import GPT, TINY_GPT, invoke, log_lines, write_corpus

import theseus
from theseus.data import load_corpus
from theseus.inference import Sampling, load_generator
from theseus.inference.sampling import next_tokens, sample_keys
from theseus.tokenization.folder import load_tokenizer
from theseus.tokenization.text import tokenize

PROMPTS = [[66, 101, 97], [73, 109, 112, 108, 105, 99, 105], [83, 105, 109, 112, 108, 101, 32]]
NEW_TOKENS = 32
# The runs' tokenizer-less model has ids beyond the 256 bytes (a multiple of 8, for tp=8 and
# FSDP); the BPE folder's tokenizer has more than it, so the model refuses it.
MODEL_VOCAB = 264
TOKENIZER_VOCAB = 271


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    corpus = write_corpus(root / "corpus")  # three files: split by file, as bytes are split
    result = invoke("tokenize", corpus, root / "tokens", "--vocab-size", TOKENIZER_VOCAB)
    assert result.exit_code == 0, result.output
    return corpus, root / "tokens"


def test_tokenized_folder_round_trips_and_loads(token_folder):
    corpus, folder = token_folder
    record = json.loads((folder / "tokens.json").read_text())
    assert (record["vocab_size"], record["token_dtype"]) == (TOKENIZER_VOCAB, "uint16")
    loaded = load_corpus(folder)
    bytes_corpus = load_corpus(corpus)
    assert loaded.vocab_size == TOKENIZER_VOCAB and loaded.tokenizer == folder / "tokenizer.json"
    assert np.array_equal(load_corpus(folder / "train-00000.bin").validation, loaded.validation)
    tokenizer = load_tokenizer(loaded.tokenizer)
    for tokens, raw in (
        (loaded.train, bytes_corpus.train),
        (loaded.validation, bytes_corpus.validation),
    ):
        assert tokens.dtype == np.uint16
        assert tokenizer.decode(tokens.tolist()).encode() == raw.astype(np.uint8).tobytes()
    assert record["splits"]["validation"]["bytes"] == bytes_corpus.validation.size
    assert loaded.train.size < bytes_corpus.train.size  # merges shorten the text
    # Reusing the tokenizer gives the same ids; a model smaller than the vocabulary is refused.
    again = tokenize(corpus, folder.parent / "again", tokenizer=folder / "tokenizer.json")
    assert not again.trained_tokenizer
    assert np.array_equal(load_corpus(folder.parent / "again").train, loaded.train)
    result = invoke("train", f"data.path={folder}", *TINY_GPT, "--out", folder.parent / "small")
    assert result.exit_code == 2 and f"model.vocab_size={TOKENIZER_VOCAB}" in result.output


def test_tokenize_bad_input(token_folder, tmp_path):
    corpus, folder = token_folder
    for args, fragment in [
        ((corpus, tmp_path / "a"), "exactly one of vocab_size"),
        ((corpus, tmp_path / "a", "--vocab-size", 9), "vocab_size=9"),
        ((tmp_path / "missing", tmp_path / "a", "--vocab-size", 300), "does not exist"),
        ((corpus, folder, "--vocab-size", 300), "--overwrite"),
        ((folder, tmp_path / "a", "--vocab-size", 300), "already tokenized"),
    ]:
        result = invoke("tokenize", *args)
        assert result.exit_code == 2 and fragment in result.output, result.output
        assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny tokenizer-less GPT of MODEL_VOCAB ids trained on bytes under tp=2 with FSDP on 8
    devices."""
    out = tmp_path_factory.mktemp("gen") / "run"
    with theseus.quick("gpt/train/pretrain", out) as q:
        q.shard(tp=2, fsdp=True)
        vocab = f"model.vocab_size={MODEL_VOCAB}"
        q.override(*TINY_GPT, vocab, "model.block_size=48", "training.steps=4")
        q()
    return out


def full_forward_greedy(generator, prompts, num_new):
    """Greedy tokens from full forward passes without a cache over the growing sequences (held
    right-padded in one fixed-width buffer, so the forward compiles once)."""
    trainer = generator.trainer
    model = jax.jit(lambda params, tokens: GPT.__call__(_merge(trainer, params), tokens))
    lengths = [len(p) for p in prompts]
    buffer = np.zeros((len(prompts), max(lengths) + num_new), np.int32)
    for row, prompt in enumerate(prompts):
        buffer[row, : len(prompt)] = prompt
    chosen = []
    for step in range(num_new):
        logits = np.asarray(model(generator.params, jnp.asarray(buffer)))  # (rows, width, vocab)
        last = [length + step - 1 for length in lengths]
        tokens = logits[np.arange(len(prompts)), last].argmax(-1)
        buffer[np.arange(len(prompts)), [i + 1 for i in last]] = tokens
        chosen.append(tokens)
    return np.stack(chosen, axis=1)


def _merge(trainer, params):
    from flax import nnx

    return nnx.merge(trainer.graphdef, params)


def complete(generator, sampling):
    """Two samples of each prompt (one compiled prefill and step serve every sampling)."""
    return generator.generate_ids(
        PROMPTS,
        max_new_tokens=NEW_TOKENS,
        sampling=sampling,
        seed=7,
        num_samples=2,
    ).ids


def test_same_completions_under_every_layout(run_dir):
    greedy, sampled = Sampling(temperature=0), Sampling(temperature=0.8, top_k=20)
    results = {}
    for name, changes, devices in [
        ("tp=1 on 1", {"tp": 1, "fsdp": False}, jax.devices()[:1]),
        ("tp=4 fsdp on 8", {"tp": 4, "fsdp": True}, None),  # heads split, weights gathered
    ]:
        loaded = load_generator(run_dir, policy_changes=changes, devices=devices)
        generator = loaded.generator
        assert loaded.step == 4 and loaded.meta.data_position > 0
        assert generator.trainer.topology.num_devices == len(devices or jax.devices())
        results[name] = (complete(generator, greedy), complete(generator, sampled))
        if name == "tp=1 on 1":
            expected = full_forward_greedy(generator, PROMPTS, NEW_TOKENS)
            np.testing.assert_array_equal(results[name][0][0::2], expected)
            np.testing.assert_array_equal(results[name][0][1::2], expected)
    reference = results["tp=1 on 1"]
    assert reference[1].shape == (6, NEW_TOKENS)
    assert not np.array_equal(reference[1][0], reference[1][1])  # two samples differ
    for name, (greedy_ids, sampled_ids) in results.items():
        np.testing.assert_array_equal(greedy_ids, reference[0], err_msg=name)
        np.testing.assert_array_equal(sampled_ids, reference[1], err_msg=name)


def test_generate_cli_json_and_bad_input(run_dir, token_folder, tmp_path):
    result = invoke(
        "generate",
        run_dir,
        "--prompt",
        "Be",
        "--prompt",
        "Simple",
        "--max-new-tokens",
        5,
        "--temperature",
        0.8,
        "--top-p",
        0.9,
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [c["prompt"] for c in data["completions"]] == ["Be", "Simple"]
    assert all(len(c["token_ids"]) == 5 for c in data["completions"]) and data["tokens_per_s"] > 0
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    for args, fragment in [
        ((tmp_path, "--prompt", "a"), "no checkpoints/ folder"),
        ((tmp_path / "empty", "--prompt", "a"), "no checkpoints in"),
        ((run_dir, "--prompt", "a", "--prompt", ""), "none of them empty"),
        ((run_dir, "--prompt", "x" * 48), "shorten the prompt"),
        ((run_dir, "--prompt", "a", "--temperature", -1), "temperature=-1.0"),
        ((run_dir, "--prompt", "a", "--top-p", 0), "top_p=0.0"),
        ((run_dir, "--prompt", "a", "--top-p", 1.5), "top_p=1.5"),
        (
            (run_dir, "--prompt", "a", "--tokenizer", token_folder[1] / "tokenizer.json"),
            str(TOKENIZER_VOCAB),
        ),
        (
            (run_dir, "--prompt-ids", "5,99999"),
            f"token id 99999, outside the model's vocabulary of {MODEL_VOCAB}",
        ),
    ]:
        result = invoke("generate", *args)
        assert result.exit_code == 2, (args, result.output)
        assert fragment in result.output and "Traceback" not in result.output, result.output


def test_top_k_top_p_and_greedy_limit_the_choice():
    logits = jnp.log(jnp.tile(jnp.array([0.5, 0.3, 0.15, 0.05]), (64, 1)))  # (rows, vocab)
    keys = sample_keys(jnp.uint32(3), jnp.arange(64), jnp.zeros(64, jnp.int32))

    choose = jax.jit(next_tokens, static_argnums=3)  # one compile for every setting

    def chosen(num_valid=4, **settings):
        return set(np.asarray(choose(logits, keys, Sampling(**settings).arrays(), num_valid).ids))

    assert chosen(temperature=0) == {0}
    assert chosen(temperature=1.0) == {0, 1, 2, 3}
    assert chosen(temperature=1.0, top_k=2) == {0, 1}
    assert chosen(temperature=1.0, top_p=0.6) == {0, 1}  # 0.5 < 0.6: the second is needed
    assert chosen(temperature=1.0, top_p=0.5) == {0}
    assert chosen(num_valid=3, temperature=1.0) == {0, 1, 2}


def test_a_tp2_fsdp_run_reads_on_one_device(run_dir, tmp_path):
    """A run trained under tp=2 + FSDP on 8 devices gives the same logits on 1 device with no
    layout flag (the policy that fits is named in one line), generates and exports there."""
    one, notes = jax.devices()[:1], []
    ids = [list(b"Beautiful is"), list(b"Simple beats")]
    eight = theseus.logits(run_dir, ids)
    with log_lines(notes.append):
        alone = theseus.logits(run_dir, ids, devices=one)
    np.testing.assert_allclose(alone, eight, atol=1e-5, rtol=0)
    assert [n for n in notes if "does not fit 1 device(s)" in n] == [notes[0]], notes
    assert "reading it under tp=1 zero=True fsdp=True" in notes[0]
    generated = theseus.generate(run_dir, ["Be"], max_new_tokens=2, devices=one)
    assert generated.mesh_shape == {"batch": 1, "shard": 1}
    assert len(generated.completions[0].token_ids) == 2
    theseus.export_hf(run_dir, tmp_path / "hf", devices=one)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == MODEL_VOCAB


def test_generate_by_ids_on_a_vocabulary_beyond_bytes(run_dir):
    """A tokenizer-less model of 264 ids generates from any ids below 264 (CLI and Python): the
    text shows ids that are bytes, the ids are given; an id at 264 is refused naming it."""
    assert MODEL_VOCAB == 264
    result = invoke(
        "generate", run_dir, "--prompt-ids", "260,261", "--prompt-ids", "104,105",
        "--max-new-tokens", 3, "--temperature", 0,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--- prompt '⟨260⟩⟨261⟩', sample 0" in result.stdout
    assert "--- prompt 'hi', sample 0" in result.stdout
    assert "--- token ids [260, 261] + [" in result.stdout
    generated = theseus.generate(run_dir, [[260, 261], [263, 104]], max_new_tokens=3, temperature=0)
    first = generated.completions[0]
    assert first.prompt == "⟨260⟩⟨261⟩" and first.prompt_ids == [260, 261]
    assert generated.completions[1].prompt == "⟨263⟩h"
    refused = invoke("generate", run_dir, "--prompt-ids", "5,264")
    assert refused.exit_code == 2, refused.output
    assert "token id 264, outside the model's vocabulary of 264 ids" in refused.output
