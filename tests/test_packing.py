"""Packed rows and the loss over trained tokens: the packing algorithm (every example once, rows
within their length, seeded, overlong policies, its efficiency), rows that never attend across
examples at positions that restart, padding that never trains, resumable sampling, document
masking's segments, and a loss that no layout changes when microbatches and replicas hold very
different numbers of trained tokens."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import (
    EQUIVALENCE_LLAMA,
    EQUIVALENCE_MODEL,
    FAMILIES,
    GPT_FAMILY,
    LLAMA_FAMILY,
    TINY_GPT,
    assert_same_numbers,
    invoke,
    one_device_run,
    policy_config,
    policy_id,
    run_steps,
    shared_trainer,
    uneven_batch,
)

from theseus.data.packing import (
    MASK,
    PACK_BUFFER,
    SEGMENTS,
    TOKENS,
    MaskedExamples,
    PackedSampler,
    build_rows,
    document_rows,
    first_fit_decreasing,
    pack,
)
from theseus.sharding.axis import ShardingPolicy
from theseus.training.losses import segment_positions, target_weights

ROW = 32  # row tokens (seq_len + 1)
SMALL_BLOCKS = ("model.attention_block_q=5", "model.attention_block_k=7")


def examples(count: int, seed: int = 0, longest: int = 40) -> MaskedExamples:
    """``count`` examples of random lengths (2 to ``longest`` tokens), ids and masks."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, longest + 1, count)  # (count,)
    total = int(lengths.sum())
    tokens = rng.integers(1, 200, total).astype(np.uint16)  # (total,)
    mask = (rng.random(total) < 0.6).astype(np.uint8)  # (total,)
    return MaskedExamples(tokens, mask, lengths.astype(np.int64))


def test_first_fit_decreasing_fills_rows_in_order():
    rows = first_fit_decreasing(np.array([3, 9, 4, 6, 2, 7]), 10)
    assert [r.tolist() for r in rows] == [[1], [5, 0], [3, 2], [4]]


def test_packing_places_every_example_once_within_its_row():
    data = examples(3000)
    packing = pack(data.lengths, ROW, seed=7, overlong="truncate", where="test")
    assert sorted(packing.members.tolist()) == list(range(3000))  # each exactly once
    sizes = np.add.reduceat(packing.kept, packing.row_starts[:-1])  # (rows,)
    assert sizes.max() <= ROW and packing.truncated == int((data.lengths > ROW).sum())
    np.testing.assert_array_equal(packing.kept, np.minimum(data.lengths, ROW)[packing.members])
    # Rows never take examples from two buffers of the shuffled order.
    order = np.random.default_rng([7, 0x5041]).permutation(3000)
    buffer_of = np.empty(3000, np.int64)
    buffer_of[order] = np.arange(3000) // PACK_BUFFER
    for start, stop in zip(packing.row_starts[:-1], packing.row_starts[1:], strict=True):
        assert len(set(buffer_of[packing.members[start:stop]])) == 1
    # The efficiency is the non-padding fraction of the built rows.
    rows = build_rows(data, packing, np.arange(packing.num_rows))  # (rows, 3, ROW)
    assert packing.efficiency == pytest.approx(np.mean(rows[:, SEGMENTS] != 0))
    assert packing.efficiency > 0.9
    again = pack(data.lengths, ROW, seed=7, overlong="truncate", where="test")
    np.testing.assert_array_equal(again.members, packing.members)
    other = pack(data.lengths, ROW, seed=8, overlong="truncate", where="test")
    assert not np.array_equal(other.members, packing.members)


def test_rows_hold_their_examples_and_padding_never_trains():
    data = examples(50, seed=1, longest=20)
    packing = pack(data.lengths, ROW, seed=0, overlong="error", where="test")
    rows = build_rows(data, packing, np.arange(packing.num_rows))  # (rows, 3, ROW)
    starts = data.starts
    for row, (start, stop) in enumerate(
        zip(packing.row_starts[:-1], packing.row_starts[1:], strict=True)
    ):
        offset = 0
        for segment, example in enumerate(packing.members[start:stop], start=1):
            span = slice(starts[example], starts[example] + data.lengths[example])
            here = slice(offset, offset + data.lengths[example])
            np.testing.assert_array_equal(rows[row, TOKENS, here], data.tokens[span])
            np.testing.assert_array_equal(rows[row, MASK, here], data.mask[span])
            assert (rows[row, SEGMENTS, here] == segment).all()
            offset += data.lengths[example]
        assert (rows[row, :, offset:] == 0).all()  # padding: token 0, mask 0, segment 0
    segments = jnp.asarray(rows[:, SEGMENTS])
    positions = np.asarray(segment_positions(segments[:, :-1]))  # (rows, ROW - 1)
    weights = np.asarray(target_weights(jnp.asarray(rows[:, MASK]), segments))  # (rows, ROW - 1)
    first = rows[:, SEGMENTS, 1:] != rows[:, SEGMENTS, :-1]  # target in the next segment
    assert (weights[first] == 0).all() and (weights[rows[:, SEGMENTS, :-1] == 0] == 0).all()
    assert weights.sum() == sum(
        data.mask[s + 1 : s + n].sum() for s, n in zip(starts, data.lengths, strict=True)
    )
    for row in range(3):
        for segment in np.unique(rows[row, SEGMENTS, :-1]):
            at = rows[row, SEGMENTS, :-1] == segment
            np.testing.assert_array_equal(positions[row, at], np.arange(at.sum()))


def test_overlong_examples_follow_the_setting():
    data = examples(200, seed=2, longest=60)
    long = int((data.lengths > ROW).sum())
    assert long > 10
    with pytest.raises(ValueError, match=f"{long} of 200 examples are longer.*data.overlong=drop"):
        pack(data.lengths, ROW, seed=0, overlong="error", where="test")
    dropped = pack(data.lengths, ROW, seed=0, overlong="drop", where="test")
    assert dropped.dropped == long and dropped.members.size == 200 - long
    assert (data.lengths[dropped.members] <= ROW).all()
    truncated = pack(data.lengths, ROW, seed=0, overlong="truncate", where="test")
    assert truncated.truncated == long and truncated.members.size == 200
    example = int(np.flatnonzero(data.lengths > ROW)[0])
    place = int(np.flatnonzero(truncated.members == example)[0])
    row = int(np.searchsorted(truncated.row_starts, place, side="right") - 1)
    built = build_rows(data, truncated, np.array([row]))[0]  # (3, ROW)
    segment = place - truncated.row_starts[row] + 1
    kept = built[TOKENS, built[SEGMENTS] == segment]
    start = data.starts[example]
    np.testing.assert_array_equal(kept, data.tokens[start : start + ROW])  # its first ROW tokens


def test_packed_sampler_resumes_at_a_position():
    data = examples(400, seed=3)
    sampler = PackedSampler(data, ROW - 1, seed=5, overlong="truncate", where="test")
    position = sampler.num_windows - 10  # the batch crosses into the next epoch
    batch = sampler.global_batch(position, 3, 8)  # (3, 8, 3, ROW)
    assert batch.shape == (3, 8, 3, ROW)
    fresh = PackedSampler(data, ROW - 1, seed=5, overlong="truncate", where="test")
    np.testing.assert_array_equal(fresh.global_batch(position, 3, 8), batch)  # a resumed run
    some = fresh.local_batch(position, 3, 8, np.array([2, 5]))
    np.testing.assert_array_equal(some, batch[:, [2, 5]])
    epoch = batch.reshape(24, 3, ROW)[10:]  # the next epoch's first rows, in its own order
    np.testing.assert_array_equal(epoch, fresh.global_batch(sampler.num_windows, 1, 14)[0])


def test_document_rows_start_a_segment_after_each_end_of_text():
    windows = np.array([[5, 9, 0, 4, 0, 0, 7]])  # end-of-text is 0
    rows = document_rows(windows, eos_id=0)  # (1, 3, 7)
    np.testing.assert_array_equal(rows[0, SEGMENTS], [1, 1, 1, 2, 2, 3, 4])
    np.testing.assert_array_equal(rows[0, MASK], np.ones(7))
    np.testing.assert_array_equal(document_rows(windows, eos_id=None)[0, SEGMENTS], np.ones(7))
    positions = segment_positions(jnp.asarray(rows[:, SEGMENTS, :-1]))
    np.testing.assert_array_equal(positions[0], [0, 1, 2, 0, 1, 0])


@pytest.mark.parametrize("family", ["gpt", "llama", "gemma"])
def test_a_packed_row_reads_no_other_example(family):
    """Each example's logits in a packed row equal its logits alone (no cross-segment
    attention; positions, learned or rotary, restart)."""
    model_class, config = support_model(family)
    graphdef, params = nnx.split(model_class(config, rngs=nnx.Rngs(0)))
    lengths = [7, 5, 9]
    ids = np.random.default_rng(0).integers(1, 200, sum(lengths))  # (21,)
    segments = np.repeat(np.arange(1, 4), lengths)[None]  # (1, 21)
    packed = jax.jit(
        lambda p: nnx.merge(graphdef, p)(
            jnp.asarray(ids[None]), segments=segments, positions=segment_positions(segments)
        )
    )(params)  # (1, 21, vocab)
    starts = np.cumsum([0, *lengths[:-1]])
    alone = np.zeros((3, max(lengths)), np.int32)  # each example alone, padded on the right
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        alone[row, :length] = ids[start : start + length]
    want = jax.jit(lambda p: nnx.merge(graphdef, p)(jnp.asarray(alone)))(params)
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        got = packed[0, start : start + length]
        np.testing.assert_allclose(got, want[row, :length], atol=2e-5, rtol=0)


def support_model(family: str):
    """A family's model class and a small config: GPT (learned positions), Llama (rotary, every
    feature on), Gemma (sliding windows of 4 on two of three layers, per-layer rotary)."""
    if family == "gpt":
        return GPT_FAMILY.model_class, EQUIVALENCE_MODEL.model_copy(update={"dropout": 0.0})
    if family == "llama":
        return LLAMA_FAMILY.model_class, EQUIVALENCE_LLAMA
    gemma = FAMILIES["gemma"].family
    fields = EQUIVALENCE_LLAMA.model_dump(include=set(gemma.config_class.model_fields))
    windows = ("sliding_attention", "full_attention", "sliding_attention")
    config = gemma.config_class(**fields | dict(sliding_window=4, layer_types=windows))
    return gemma.model_class, config


def even_cuts(index: int, j: int, width: int) -> np.ndarray:
    """Example ``j`` cut into ``1 + j % 3`` segments of about equal length."""
    return np.linspace(0, width, 2 + j % 3).astype(int)[1:-1]


def masked_batch(trainer, index: int) -> jax.Array:
    """Step ``index``'s segmented rows of :func:`support.uneven_batch`, cut by ``even_cuts``."""
    return uneven_batch(trainer, index, even_cuts)


# Each policy once, each mode (one microbatch with dropout, four without) at least once, and the
# four microbatches under tp=2 + FSDP, whose mean crosses both the microbatches and the devices.
UNEVEN_CASES = [
    (ShardingPolicy(tp=2), 1, 0.1),
    (ShardingPolicy(tp=1, fsdp=True), 1, 0.1),
    (ShardingPolicy(tp=2, fsdp=True), 4, 0.0),
]


@pytest.mark.parametrize(
    ("policy", "accumulation", "dropout"),
    UNEVEN_CASES,
    ids=[f"{policy_id(p)}-{a}-{d}" for p, a, d in UNEVEN_CASES],
)
def test_uneven_trained_tokens_give_the_one_device_numbers(policy, accumulation, dropout):
    """With dropout (on the probabilities it runs the written-out attention) and without it,
    where the CPU's blockwise kernel runs in blocks of 5 queries and 7 keys: several of each in a
    24-token row, segments and padding starting inside blocks, so its loop bounds differ by
    block and by row."""
    model = EQUIVALENCE_MODEL.model_copy(update={"dropout": dropout})
    config = policy_config(policy, accumulation, model, *SMALL_BLOCKS)
    got = run_steps(shared_trainer(config, policy), batches=masked_batch)
    assert_same_numbers(got, one_device_run(config, batches=masked_batch))


def write_tokenized(folder, data: MaskedExamples, *, masked: bool, train: int) -> str:
    """A tokenized folder of ``data``'s first ``train`` examples and the rest as validation: a
    chat folder (tokens, masks, lengths) when ``masked``, else a pretraining stream (end-of-text
    id 0). Returns the folder as a string."""
    from theseus.data.shards import FORMAT

    folder.mkdir()
    cut = int(data.lengths[:train].sum())
    splits = {}
    for name, part, lengths in (
        ("train", slice(0, cut), data.lengths[:train]),
        ("validation", slice(cut, None), data.lengths[train:]),
    ):
        data.tokens[part].tofile(folder / f"{name}-00000.bin")
        shard = {"name": f"{name}-00000.bin", "tokens": int(lengths.sum())}
        if masked:
            data.mask[part].tofile(folder / f"{name}-00000.mask")
            lengths.astype(np.uint32).tofile(folder / f"{name}-00000.docs")
            shard |= {"mask": f"{name}-00000.mask", "docs": f"{name}-00000.docs"}
        splits[name] = {"shards": [shard]}
    manifest = {"format": FORMAT, "vocab_size": 256, "token_dtype": "uint16", "eos_id": 0}
    manifest |= {"loss_mask": masked, "splits": splits}
    (folder / "tokens.json").write_text(json.dumps(manifest))
    (folder / "tokenizer.json").write_text("{}")
    return str(folder)


def test_overlong_examples_stop_the_command_line_before_anything_is_written(tmp_path):
    """A chat-like tokenized folder with examples longer than a row: exit 2, one paragraph
    naming data.overlong, no run directory. (tests/test_lora_hf.py trains a chat corpus from
    the command line.)"""
    data = examples(600, seed=4, longest=24)  # rows of TINY_GPT's 16 + 1 tokens
    folder = write_tokenized(tmp_path / "chat", data, masked=True, train=480)
    run = tmp_path / "run"
    refused = invoke("train", f"data.path={folder}", *TINY_GPT, "--out", run)
    assert refused.exit_code == 2 and "data.overlong=truncate" in refused.output
    assert "Traceback" not in refused.output and not run.exists()


def test_a_packed_run_resumes_with_the_numbers_of_an_uninterrupted_one(tmp_path):
    """A chat-like folder trained 4 steps, and the same run resumed from its step-2 checkpoint
    (the newest one removed, as a run stopped after step 2 leaves it): the resumed steps'
    losses and trained-token counts are the uninterrupted run's, bit for bit (the packed rows
    are rebuilt from the seed and continue at the saved position)."""
    import shutil

    from theseus.plot import read_metrics

    folder = write_tokenized(tmp_path / "chat", examples(500, seed=7, longest=12), masked=True,
                             train=450)  # fmt: skip
    train = ("train", f"data.path={folder}", *TINY_GPT, "training.steps=4")
    whole = invoke(*train, "--out", tmp_path / "whole")
    assert whole.exit_code == 0, whole.output
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = invoke(*train, "--out", tmp_path / "resumed", "--resume")
    assert resumed.exit_code == 0 and "resumed from step 2" in resumed.output, resumed.output

    def rows(run):
        return [
            (r["step"], r["loss"], r["trained_tokens"])
            for r in read_metrics(run) if "trained_tokens" in r and r["step"] > 2
        ]  # fmt: skip

    assert len(rows(tmp_path / "whole")) == 2
    assert rows(tmp_path / "resumed") == rows(tmp_path / "whole")


def test_a_mixture_of_chat_and_pretraining_gives_one_row_format(tmp_path):
    """data.sources mixing a chat folder with a pretraining folder: every row is segmented;
    the stream's rows train every target, one segment each (or, with document masking, a
    segment per document)."""
    from theseus.config import DataConfig
    from theseus.data import load_mixture

    chat = write_tokenized(tmp_path / "chat", examples(300, seed=5), masked=True, train=250)
    stream = write_tokenized(tmp_path / "web", examples(300, seed=6), masked=False, train=250)
    for masking in (False, True):
        config = DataConfig(
            sources=f"{chat}:0.5,{stream}:0.5", overlong="truncate", document_masking=masking
        )
        mixture = load_mixture(config)
        sampler = mixture.sampler(15, seed=0)
        batch = sampler.global_batch(0, 2, 16).reshape(32, 3, 16)  # (rows, fields, 16)
        from_stream = sampler.sources(np.arange(32)) == 1
        assert 0 < from_stream.sum() < 32
        assert (batch[from_stream, MASK] == 1).all()
        segments = batch[from_stream, SEGMENTS]  # (stream rows, 16)
        tokens = batch[from_stream, TOKENS]
        if masking:  # a new segment after each end-of-text (id 0)
            ends = np.cumsum(tokens == 0, axis=1) - (tokens == 0)
            np.testing.assert_array_equal(segments, 1 + ends)
        else:
            assert (segments == 1).all()
        assert (batch[~from_stream, SEGMENTS].max(axis=1) > 1).any()  # packed examples
        assert set(mixture.validation(mixture.sources[0], 15, 1, 4).shape) == {1, 4, 3, 16}


def test_document_masking_needs_an_end_of_text_token():
    from theseus.config import DataConfig
    from theseus.data import load_mixture

    with pytest.raises(ValueError, match="document_masking=true splits documents at the end"):
        load_mixture(DataConfig(document_masking=True))
    plain = load_mixture(DataConfig())
    assert not plain.segmented and plain.row_shape(16) == (17,)
