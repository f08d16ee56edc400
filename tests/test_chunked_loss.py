"""The loss computed a chunk of positions at a time (theseus.model.head.chunked_scores): the same
log-probabilities, loss and gradients as the whole sequence's logits (a length that is no multiple
of the chunk, a mask, Gemma's soft cap and tied head), and a compiled step that holds no
(sequence, vocabulary) buffer. Task scoring (theseus.inference.scoring) runs the head in chunks
too: the same log-likelihoods and greedy flags, and no (tokens, vocabulary) buffer at 32,768
tokens. MFU's FLOPs count the head the chunked loss recomputes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from support import (
    EQUIVALENCE_LLAMA,
    FAMILIES,
    LlamaTrainer,
    assert_same_numbers,
    one_device_run,
    policy_config,
    run_steps,
    shared_trainer,
)

from theseus.config import apply_overrides
from theseus.inference.scoring import Scorer, scored_window
from theseus.model.head import default_chunk
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.flops import xla_flops_per_token

GEMMA_FAMILY = FAMILIES["gemma"].family
# Prime dimensions apart from every other: 31 positions (no multiple of the chunk of 8), a
# vocabulary of 211, a tied head and a final soft cap of 8.
SEQ, VOCAB, CHUNK = 31, 211, 8
GEMMA = GEMMA_FAMILY.config_class(
    vocab_size=VOCAB,
    hidden_size=40,
    intermediate_size=48,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=SEQ,
    tie_word_embeddings=True,
    final_logit_softcapping=8.0,
)


def whole_logps(model, tokens, targets):
    """The targets' log-probabilities from the whole sequence's logits (batch, seq, vocab)."""
    logits = model(tokens)  # (batch, seq, vocab) float32
    return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def test_chunked_loss_and_gradients_equal_the_whole_sequence():
    model = GEMMA_FAMILY.model_class(GEMMA, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.integers(0, VOCAB, (3, SEQ + 1)), jnp.int32)
    weights = jnp.asarray(rng.random((3, SEQ)) < 0.6, jnp.float32)  # (3, seq)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, scored):
        logps = scored(nnx.merge(graphdef, params), rows[:, :-1], rows[:, 1:])  # (3, seq)
        return -jnp.sum(logps * weights) / jnp.sum(weights), logps

    def chunked(m, tokens, targets):
        return m.target_logps(tokens, targets, chunk=CHUNK).logps

    grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (got, got_logps), got_grads = grads(params, chunked)
    (want, want_logps), want_grads = grads(params, whole_logps)
    np.testing.assert_allclose(got_logps, want_logps, rtol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    flat = jax.tree_util.tree_flatten_with_path(got_grads)[0]
    for (path, value), expected in zip(flat, jax.tree.leaves(want_grads), strict=True):
        scale = float(jnp.abs(expected).max())
        np.testing.assert_allclose(value, expected, atol=1e-6 * scale, rtol=0, err_msg=str(path))


def test_chunks_under_tp2_fsdp_and_accumulation_equal_one_device_whole():
    """Chunks of 7 of the 24 positions (three and a remainder of 3) under tp=2 + FSDP with 2
    microbatches: the numbers of one device computing the whole sequence at once (the suite's
    tolerances), validation included."""
    policy = ShardingPolicy(tp=2, fsdp=True)
    trainer = shared_trainer(
        policy_config(policy, 2, EQUIVALENCE_LLAMA, "training.loss_chunk=7"), policy
    )
    assert trainer.loss_chunk == 7 and trainer.batch_plan.accumulation_steps == 2
    whole = policy_config(policy, 2, EQUIVALENCE_LLAMA)
    assert_same_numbers(run_steps(trainer, validation=1), one_device_run(whole, validation=1))


def one_layer_llama(chunk: int, *, seq: int = SEQ, vocab: int = VOCAB, examples: int = 3):
    """A 1-layer Llama trainer on one device (``seq`` positions, a vocabulary of ``vocab``,
    ``examples`` per step) with ``training.loss_chunk=chunk``."""
    config = apply_overrides(
        LlamaTrainer.config_class(model=EQUIVALENCE_LLAMA),
        [
            "model.num_layers=1",
            f"model.vocab_size={vocab}",
            f"model.max_position_embeddings={seq}",
            f"training.seq_len={seq}",
            f"training.batch_size={examples}",
            f"training.per_device_batch_size={examples}",
            f"training.loss_chunk={chunk}",
        ],
    )
    policy = ShardingPolicy()
    return LlamaTrainer(config, policy, Topology.new(policy, devices=jax.devices()[:1]))


def array_shapes(hlo: str) -> list[list[int]]:
    return [[int(d) for d in s.split(",") if d] for s in re.findall(r"\[([0-9,]+)\]", hlo)]


def step_shapes(chunk: int) -> list[list[int]]:
    """The array shapes of a 1-layer Llama's train step (seq 31, vocabulary 211) compiled for
    one device with ``training.loss_chunk=chunk``."""
    return array_shapes(one_layer_llama(chunk).compile().executable.as_text())


def test_the_compiled_step_holds_no_sequence_by_vocabulary_buffer():
    """Chunks of 8: no buffer has both the sequence's and the vocabulary's length; the whole
    sequence as one chunk (the control) holds such buffers."""
    chunked = [s for s in step_shapes(CHUNK) if SEQ in s and VOCAB in s]
    whole = [s for s in step_shapes(SEQ) if SEQ in s and VOCAB in s]
    assert not chunked, chunked[:3]
    assert whole


def test_the_default_chunk_bounds_a_chunk_of_logits():
    """Llama 3.1 8B's vocabulary: 512 positions (256 MiB of float32 logits per example); the
    test models' vocabularies: the whole of any sequence they read."""
    assert default_chunk(128256, 1) == 512
    assert default_chunk(128256, 2) == 256
    assert default_chunk(256000, 1) == 256
    assert default_chunk(256, 32) == 8192


def test_scores_in_chunks_equal_the_whole_logits():
    """Chunks of 7 of the 31 positions (four and a remainder of 3): each continuation's summed
    log-probability within 1e-5 of the whole logits' and the same greedy flags, for a
    continuation across chunks, greedy ones and a context cut to the model's."""
    trainer = one_layer_llama(7)
    with nnx.use_eager_sharding(False):
        model = trainer.build_model(nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    whole = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))  # (rows, SEQ, VOCAB) logits
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, VOCAB, n).tolist() for n in (28, 20, 40, 9)]

    def inputs(windows):  # what the scorer runs: (4, SEQ) token rows
        rows = np.zeros((4, SEQ), np.int32)
        for row, kept in enumerate(windows):
            rows[row, : len(kept)] = kept
        return np.asarray(whole(state, rows))

    logits = inputs([c[-SEQ:] for c in contexts])  # the tokens after each context, greedily
    nexts = [int(logits[row, len(c[-SEQ:]) - 1].argmax()) for row, c in enumerate(contexts)]
    requests = [
        (contexts[0], rng.integers(0, VOCAB, 4).tolist()),  # scored positions 27-30
        (contexts[1], [nexts[1]]),
        (contexts[2], [nexts[2]]),  # 41 tokens: the last 32 kept
        (contexts[3], [nexts[3], *rng.integers(0, VOCAB, 4).tolist()]),
    ]
    windows = [scored_window(c, t, SEQ) for c, t in requests]
    logps = jax.nn.log_softmax(inputs([kept[:-1] for kept, _ in windows]))
    want_logps, want_greedy = [], []
    for row, (kept, num) in enumerate(windows):
        positions = np.arange(len(kept) - 1 - num, len(kept) - 1)
        targets = np.asarray(kept[-num:])
        want_logps.append(float(logps[row, positions, targets].sum()))
        want_greedy.append(bool((logps[row, positions].argmax(-1) == targets).all()))
    scorer = Scorer(trainer, nnx.to_pure_dict(state))
    assert scorer.chunk == 7 and scorer.widths == [SEQ]
    got = scorer.score(requests)
    np.testing.assert_allclose([s.logprob for s in got], want_logps, rtol=1e-5)
    assert [s.is_greedy for s in got] == want_greedy == [False, True, True, False]


def test_scoring_32768_tokens_holds_no_tokens_by_vocabulary_buffer():
    """`theseus evaluate --tasks` on a run of 32,768-token documents and a 32,000-token
    vocabulary: its scoring program (compiled, not run) holds no buffer with both lengths, and
    its temporaries stay under 1 GiB, where one row's whole logits take 4 GiB (4 rows: 16)."""
    seq, vocab = 32768, 32000
    trainer = one_layer_llama(default_chunk(vocab, 4), seq=seq, vocab=vocab, examples=1)
    scorer = Scorer(trainer, None)  # 4 rows per replica, chunks of 512 positions
    assert scorer.chunk == 512 and scorer.widths[-1] == seq
    program = scorer.program(seq)
    assert not [s for s in array_shapes(program.as_text()) if seq in s and vocab in s]
    assert program.memory_analysis().temp_size_in_bytes < 2**30


def test_flops_count_the_head_the_chunked_loss_recomputes():
    """A 1-layer Llama (31 positions, vocabulary 211, width 40): in chunks of 8 the head runs
    again in the backward, 2 × 211 × 40 more FLOPs per token than one chunk, and XLA's count of
    the step grows by that within 10% (the recomputed softmax besides)."""
    matmuls = 6 * (40 * (64 + 2 * 16 + 64 + 3 * 48) + 40 * VOCAB)  # q, k, v, o, MLP; head
    attention = 12 * SEQ * 64  # q kᵀ and probs v over 31 keys, 8 heads of 8
    recomputed = 2 * 40 * VOCAB
    one, chunked = one_layer_llama(SEQ), one_layer_llama(CHUNK)
    assert one.flops_per_token() == matmuls + attention == 147408
    assert chunked.flops_per_token() == matmuls + attention + recomputed == 164288
    added = xla_flops_per_token(chunked) - xla_flops_per_token(one)
    assert 1 <= added / recomputed <= 1.1, added
