"""Preference tuning: the losses against TRL's own code (float32, the same log-probabilities),
packed pairs' log-probabilities against TRL's on a transformers model, and the trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import shutil
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import VOCAB, Reference, byte_tokenizer, libraries, saved_logits
from support import FAMILIES, invoke, policy_id, trl_module

import theseus
from theseus.checkpoint.checkpointer import Checkpointer
from theseus.config import apply_overrides
from theseus.data.packing import MaskedExamples
from theseus.data.pairs import PairSampler, examples_of_pairs
from theseus.data.shards import FORMAT
from theseus.hf.exporter import tensor_values
from theseus.hf.importer import import_hf
from theseus.inference.logits import load_run
from theseus.jobs import families as registered_families
from theseus.jobs import get_job
from theseus.plan import plan
from theseus.plot import read_metrics
from theseus.posttraining.preference.objective import (
    METRICS,
    PairLogps,
    PreferenceConfig,
    pair_losses,
)
from theseus.posttraining.preference.reference import REFERENCE_FILE, split_reference
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.keys import validation_keys
from theseus.training.run.checkpointing import checkpoint_meta, restore_reference, restore_target
from theseus.training.state import reference_of

PAIRS = 5
RNG = np.random.default_rng(7)
LENGTHS = RNG.integers(1, 12, (2, PAIRS))  # completion tokens: chosen, rejected
LOGPS = -RNG.uniform(0.05, 3.0, (4, PAIRS)) * LENGTHS[[0, 1, 0, 1]]  # policy c/r, reference c/r


def _ours(config: PreferenceConfig, pairs: slice = slice(None)):
    lengths = jnp.asarray(LENGTHS[:, pairs], jnp.float32)
    logps = jnp.asarray(LOGPS[:, pairs], jnp.float32)
    policy = PairLogps(logps[0], logps[1], lengths[0], lengths[1])
    reference = PairLogps(logps[2], logps[3], lengths[0], lengths[1])
    return pair_losses(config, policy, reference if config.has_reference else None)


def _identity(x):
    return x


def _accelerator(torch):
    return SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=_identity, gather=_identity
    )


def _trainer_stub(torch, **settings):
    """What TRL's ``DPOTrainer._compute_loss`` reads of its trainer, with the loss ``settings``
    (one process, precomputed reference log-probabilities)."""
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_accelerator(torch),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
        **settings,
    )


def _trl_dpo(torch, pairs: slice, **settings) -> tuple[float, dict]:
    """TRL's DPOTrainer._compute_loss on a stand-in model whose per-token log-probabilities sum,
    over each completion's tokens, to the test's (spread evenly over them)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    lengths = np.concatenate(LENGTHS[:, pairs])  # (2 × pairs,) chosen first
    logps = np.concatenate(LOGPS[:2, pairs])
    width = int(lengths.max()) + 3
    mask = np.zeros((lengths.size, width), np.int64)
    for row, n in enumerate(lengths):
        mask[row, 2 : 2 + n] = 1  # a prompt of two tokens, then the completion
    per_token = torch.tensor(mask[:, 1:] * (logps / lengths)[:, None], dtype=torch.float32)
    zeros = torch.zeros_like(per_token)
    model = lambda **kwargs: SimpleNamespace(  # noqa: E731
        log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
    )
    stub = _trainer_stub(torch, **settings)
    inputs = {
        "input_ids": torch.zeros(mask.shape, dtype=torch.long),
        "attention_mask": torch.ones(mask.shape, dtype=torch.long),
        "completion_mask": torch.tensor(mask),
        "ref_chosen_logps": torch.tensor(LOGPS[2, pairs], dtype=torch.float32),
        "ref_rejected_logps": torch.tensor(LOGPS[3, pairs], dtype=torch.float32),
    }
    loss = DPOTrainer._compute_loss(stub, model, inputs, False)
    return float(loss), {k: v[-1] for k, v in stub._metrics["train"].items()}


def _trl_reference_free(torch, loss: str, pairs: slice, beta: float, **settings):
    """TRL's CPOTrainer (simpo) or ORPOTrainer get_batch_loss_metrics, its forward standing in:
    mean token log-probabilities and the chosen tokens' NLL."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    lengths = LENGTHS[:, pairs]
    sums = torch.tensor(LOGPS[:2, pairs], dtype=torch.float32)
    means = sums / torch.tensor(lengths, dtype=torch.float32)
    nll = -sums[0].sum() / float(lengths[0].sum())
    logits = torch.zeros(1)
    stub = SimpleNamespace(
        accelerator=_accelerator(torch),
        aux_loss_enabled=False,
        beta=beta,
        concatenated_forward=lambda model, batch: (means[0], means[1], logits, logits, nll),
        **settings,
    )
    if loss == "simpo":
        stub.cpo_loss = lambda c, r: CPOTrainer.cpo_loss(stub, c, r)
        value, metrics = CPOTrainer.get_batch_loss_metrics(stub, None, {})
    else:
        stub.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(stub, c, r)
        value, metrics = ORPOTrainer.get_batch_loss_metrics(stub, None, {})
    return float(value), metrics


DPO_CASES = {
    "sigmoid": ({"beta": 0.3}, {"loss_types": ["sigmoid"]}),
    "robust": (
        {"beta": 0.2, "label_smoothing": 0.15},
        {"loss_types": ["robust"], "label_smoothing": 0.15},
    ),
    "ipo": ({"beta": 0.4}, {"loss_types": ["ipo"]}),
    "hinge": ({"beta": 0.7}, {"loss_types": ["hinge"]}),
    "rpo": ({"beta": 0.3, "rpo_alpha": 0.6}, {"loss_types": ["sigmoid", "sft"]}),
}


@pytest.mark.parametrize("loss", sorted(DPO_CASES))
def test_dpo_family_equals_trl(loss):
    """The batch mean of our per-pair losses and rewards equals TRL's DPOTrainer on the same
    log-probabilities (float32, 1e-6); RPO's NLL term, a per-pair mean in theseus, is compared
    pair by pair (TRL's token mean over the batch equals it on one pair)."""
    torch = libraries().torch
    ours_settings, trl_settings = DPO_CASES[loss]
    config = PreferenceConfig(loss=loss, **ours_settings)
    trl_settings = {"beta": config.beta, "label_smoothing": 0.0, **trl_settings}
    weights = [1.0, config.rpo_alpha] if loss == "rpo" else [1.0]
    batches = [slice(p, p + 1) for p in range(PAIRS)] if loss == "rpo" else [slice(None)]
    for pairs in batches:
        want_loss, want = _trl_dpo(torch, pairs, loss_weights=weights, **trl_settings)
        got = _ours(config, pairs)
        assert abs(float(got.loss.mean()) - want_loss) <= 1e-6
        ones = jnp.ones(got.loss.shape)
        sums = got.metric_sums(ones)
        for name, value in sums.items():
            assert abs(float(value) / ones.size - want[name]) <= 1e-6 * max(1, abs(want[name]))
    chosen = config.beta * (LOGPS[0] - LOGPS[2])  # rewards/chosen = beta · (policy − ref)
    np.testing.assert_allclose(_ours(config).chosen_rewards, chosen, rtol=1e-6)


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_equal_trl(loss):
    """SimPO (TRL's CPOTrainer, loss_type=simpo, cpo_alpha=0) on the whole batch, and ORPO
    (ORPOTrainer) pair by pair: its NLL term is per pair here, TRL's a token mean of the batch."""
    torch = libraries().torch
    config = (
        PreferenceConfig(loss="simpo", beta=2.0, gamma=0.7, label_smoothing=0.1)
        if loss == "simpo"
        else PreferenceConfig(loss="orpo", beta=0.25)
    )
    settings = (
        {"loss_type": "simpo", "label_smoothing": 0.1, "simpo_gamma": 0.7, "cpo_alpha": 0.0,
         "alpha": 0.0}
        if loss == "simpo"
        else {}
    )  # fmt: skip
    batches = [slice(None)] if loss == "simpo" else [slice(p, p + 1) for p in range(PAIRS)]
    for pairs in batches:
        want_loss, want = _trl_reference_free(torch, loss, pairs, config.beta, **settings)
        got = _ours(config, pairs)
        assert abs(float(got.loss.mean()) - want_loss) <= 1e-6
        sums = got.metric_sums(jnp.ones(got.loss.shape))
        for name, value in sums.items():
            want_value = float(want[name])
            assert abs(float(value) / got.loss.size - want_value) <= 1e-6 * max(1, abs(want_value))


def test_dpo_at_the_reference_is_ln2():
    """Policy = reference: DPO's loss is ln 2 and every reward 0."""
    lengths = jnp.asarray(LENGTHS, jnp.float32)
    same = PairLogps(jnp.asarray(LOGPS[0]), jnp.asarray(LOGPS[1]), lengths[0], lengths[1])
    got = pair_losses(PreferenceConfig(), same, same)
    np.testing.assert_allclose(got.loss, math.log(2), atol=1e-7)
    assert (
        float(jnp.abs(got.chosen_rewards).max()) == 0 == float(jnp.abs(got.rejected_rewards).max())
    )


HF_KINDS = ["llama", "qwen2"]  # Qwen2: biases on q, k and v, a tied head


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``imported(kind)``: a tiny random transformers model (float32, ``hf_reference.KINDS``)
    with TRL's fused head (as DPOTrainer adds it), and the theseus run importing it; made once
    per kind."""
    made: dict[str, tuple[Reference, Path]] = {}

    def get(kind: str) -> tuple[Reference, Path]:
        trl_module()  # a skip without the hf-reference extra (a failure under CI)
        from trl.trainer.utils import add_fused_lm_head

        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            reference = Reference(kind, folder / "hf")
            outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
            add_fused_lm_head(reference.model, outputs=outputs)
            import_hf(reference.directory, folder / "run")
            made[kind] = reference, folder / "run"
        return made[kind]

    return get


def _records(count: int, seed: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "prompt_ids": rng.integers(1, VOCAB, rng.integers(2, 9)).tolist(),
            "chosen_ids": rng.integers(1, VOCAB, rng.integers(1, 12)).tolist(),
            "rejected_ids": rng.integers(1, VOCAB, rng.integers(1, 12)).tolist(),
        }
        for _ in range(count)
    ]


def _pairs(records: list[dict[str, list[int]]]):
    """The records as (chosen ids, mask, rejected ids, mask): the mask 1 on the completion."""

    def side(record, key):
        ids = record["prompt_ids"] + record[key]
        return np.asarray(ids), np.r_[
            np.zeros(len(record["prompt_ids"])), np.ones(len(record[key]))
        ]

    return [(*side(r, "chosen_ids"), *side(r, "rejected_ids")) for r in records]


def _trl_logps(model, records) -> np.ndarray:
    """TRL's per-example completion log-probabilities (DPOTrainer.compute_ref_log_probs on the
    batch of its DataCollatorForPreference): (pairs, 2), chosen then rejected."""
    torch = libraries().torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    batch = DataCollatorForPreference(pad_token_id=0)(records)
    stub = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext),
        ref_model=None,
        model=model,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        ld_alpha=None,
    )
    chosen, rejected = DPOTrainer.compute_ref_log_probs(stub, model, batch)
    return torch.stack([chosen, rejected], 1).double().numpy()


@pytest.mark.parametrize("kind", HF_KINDS)
def test_pair_logps_equal_trl_packed_and_padded(kind, imported):
    """Per-example chosen and rejected completion log-probabilities of pair rows, packed
    (several pairs a row, segment ids and restarted positions) and padded (one pair a row),
    equal TRL's on its collator's padded batch of the same records (float32, 1e-5 relative),
    and each other (1e-5 relative)."""
    reference, run = imported(kind)
    records = _records(11, seed=3)
    loaded = load_run(
        run, job="llama/train/preference", layout="storage", devices=jax.devices()[:1]
    )
    got = {}
    for layout in ("packed", "padded"):
        sampler = PairSampler(examples_of_pairs(_pairs(records)), 63, 0, "error", layout, "t")
        got[layout] = split_reference(loaded.trainer, sampler, loaded.params).reshape(-1, 2)
        assert (sampler.num_windows < len(records)) == (layout == "packed")
    np.testing.assert_allclose(got["packed"], got["padded"], rtol=1e-5)
    want = _trl_logps(reference.model, records)
    for layout, logps in got.items():
        np.testing.assert_allclose(logps, want, rtol=1e-5, err_msg=layout)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_dpo_gradients_equal_torch(kind, imported):
    """The DPO loss's gradient of every tensor, packed pairs against a reference apart from the
    policy, equals torch's through TRL's DPOTrainer on its collator's batch (1e-4 relative, in
    norm, per tensor; theseus's gradients laid out as the exporter lays out weights)."""
    torch = libraries().torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    reference, run = imported(kind)
    records = _records(6, seed=4)
    loaded = load_run(run, job=PREF_JOB, layout="storage", devices=jax.devices()[:1])
    trainer, params = loaded.trainer, loaded.params
    examples = examples_of_pairs(_pairs(records))
    sampler = PairSampler(examples, 63, 0, "error", "packed", "test")
    offsets = np.random.default_rng(2).normal(0, 3, examples.lengths.size).astype(np.float32)
    stored = split_reference(trainer, sampler, params) + offsets  # a reference apart
    sampler = PairSampler(examples, 63, 0, "error", "packed", "test", stored)
    rows = jnp.asarray(sampler.rows(np.arange(sampler.num_windows)))

    def mean_loss(params):
        model = nnx.merge(trainer.graphdef, params)
        return trainer.token_loss(model, rows, validation_keys(rows.shape[:1]), train=True).mean()

    grads = jax.jit(jax.grad(mean_loss))(params)
    batch = DataCollatorForPreference(pad_token_id=0)(records)
    batch["ref_chosen_logps"] = torch.tensor(stored[0::2])
    batch["ref_rejected_logps"] = torch.tensor(stored[1::2])
    stub = _trainer_stub(
        torch, beta=0.1, loss_types=["sigmoid"], loss_weights=[1.0], label_smoothing=0.0
    )
    model = reference.model
    model.zero_grad()
    DPOTrainer._compute_loss(stub, model, batch, False).backward()
    theirs = dict(model.named_parameters())
    family = registered_families()["llama"].family
    tensors = family.hf.tensors(trainer.config.model.model_dump(mode="json"))
    compared = set()
    for name, blocks in tensor_values(grads, tensors, np.float32):
        compared.add(name)
        ours, want = np.concatenate(list(blocks)), theirs[name].grad.double().numpy()
        error = np.linalg.norm(ours - want) / np.linalg.norm(want)
        assert error <= 1e-4, (name, error)
    assert compared == set(theirs)  # every tensor (q/k/v biases among Qwen2's)


# --- the trainer ---------------------------------------------------------------------------------

LlamaConfig = FAMILIES["llama"].family.config_class
PREF_MODEL = LlamaConfig(
    vocab_size=64,
    hidden_size=24,
    intermediate_size=40,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings")  # fmt: skip

PREF_JOB = "llama/train/preference"
SEQ_LEN = 31
BATCH = 16  # rows: pairs under the padded layout


@functools.cache
def _examples():
    rng = np.random.default_rng(5)

    def pair():
        prompt = rng.integers(0, 64, rng.integers(3, 8))
        sides = [rng.integers(0, 64, rng.integers(2, 7)) for _ in range(2)]
        masks = [np.r_[np.zeros(prompt.size), np.ones(s.size)] for s in sides]
        ids = [np.concatenate([prompt, s]) for s in sides]
        return ids[0], masks[0], ids[1], masks[1]

    return examples_of_pairs([pair() for _ in range(56)])


MOE_JOB = "qwen3_moe/train/preference"
MODELS = {
    PREF_JOB: PREF_MODEL,
    MOE_JOB: FAMILIES["qwen3_moe"].family.config_class(
        **PREF_MODEL.model_dump(include=set(MODEL_FIELDS)), num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.05,
    ),
}  # fmt: skip


@functools.cache  # one compiled step per settings
def _trainer(
    policy: ShardingPolicy,
    accumulation: int,
    *overrides: str,
    devices: int = 8,
    job: str = PREF_JOB,
):
    cls = get_job(job).trainer_class
    replicas = devices // policy.tp
    settings = [
        f"training.batch_size={BATCH}",
        f"training.per_device_batch_size={BATCH // (replicas * accumulation)}",
        f"training.seq_len={SEQ_LEN}",
        "optimization.learning_rate=1e-3",
        "optimization.warmup_steps=1",
        *overrides,
    ]
    config = apply_overrides(cls.config_class(model=MODELS[job]), settings)
    topology = Topology.new(policy, devices=jax.devices()[:devices])
    return cls(config, policy, topology)


@dataclasses.dataclass(frozen=True)
class PrefRun:
    metrics: dict[str, np.ndarray]  # name -> (steps,) (steps, experts) for expert_load
    params: Any


def _run(trainer, layout: str = "packed", steps: int = 3) -> PrefRun:
    """``steps`` steps on the test's pairs, the reference precomputed on the trainer's mesh."""
    state = trainer.init_state()
    sampler = PairSampler(_examples(), SEQ_LEN, 0, "error", layout, "test")
    if trainer.preference.reference_mode == "precomputed":
        reference = split_reference(trainer, sampler, state.params)
        sampler = PairSampler(_examples(), SEQ_LEN, 0, "error", layout, "test", reference)
    plan, rows = trainer.batch_plan, []
    for index in range(steps):
        batch = sampler.global_batch(
            index * BATCH, plan.accumulation_steps, plan.examples_per_microbatch
        )
        state, metrics = trainer.train_step(state, trainer.put_batch(_rows_of(batch), batch.shape))
        rows.append(jax.device_get(metrics))
    stacked = {name: np.array([np.asarray(r[name]) for r in rows]) for name in rows[0]}
    return PrefRun(stacked, jax.device_get(state.params))


def _rows_of(batch):
    return lambda rows: batch[:, rows]


@functools.cache
def _one_device() -> PrefRun:
    return _run(_trainer(ShardingPolicy(), 1, devices=1))


def _starts_at_ln2(run: PrefRun) -> None:
    """Step 0, the reference equal to the policy: the DPO loss is ln 2 and every reward 0."""
    first = {name: values[0] for name, values in run.metrics.items()}
    assert abs(first["loss"] - math.log(2)) <= 1e-5
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(first[name]) <= 1e-5, (name, first[name])
    assert first["rewards/accuracies"] <= 0.5  # no reward above another


def test_dpo_starts_at_ln2_with_zero_rewards_packed_and_padded():
    """One device, packed and padded rows: the DPO loss starts at ln 2, every reward at 0 (the
    other policies: test_layouts_and_accumulation_change_nothing)."""
    _starts_at_ln2(_one_device())
    _starts_at_ln2(_run(_trainer(ShardingPolicy(), 1, devices=1), "padded", steps=1))


COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "trained_tokens")  # fmt: skip


@pytest.mark.parametrize(
    "policy", [ShardingPolicy(tp=2), ShardingPolicy(tp=2, fsdp=True)], ids=policy_id
)
def test_layouts_and_accumulation_change_nothing(policy):
    """tp=2, and tp=2 + FSDP with 4 microbatches, equal one device: losses and rewards within
    1e-4 relative (1e-5 absolute, for rewards near 0), parameters within 1e-4; step 0, packed and
    padded, is ln 2 with zero rewards. (FSDP alone stores and gathers as tp=2 + FSDP does, the
    trainer's code that GPT's matrix proves: tests/test_trainer.py.)"""
    want = _one_device()
    trainer = _trainer(policy, 4 if policy.tp == 2 and policy.fsdp else 1)
    got = _run(trainer)
    _starts_at_ln2(got)
    _starts_at_ln2(_run(trainer, "padded", steps=1))
    for name in COMPARED:
        np.testing.assert_allclose(
            got.metrics[name], want.metrics[name], rtol=1e-4, atol=1e-5, err_msg=name
        )
    assert got.metrics["loss"][-1] < got.metrics["loss"][0]
    for path, value in jax.tree_util.tree_flatten_with_path(got.params)[0]:
        expected = functools.reduce(lambda tree, key: tree[key.key], path, want.params)
        np.testing.assert_allclose(value, expected, atol=1e-4, rtol=0, err_msg=str(path))


LORA = "finetune.lora_rank=4"


def _lora_trainer(reference: str):
    return _trainer(ShardingPolicy(fsdp=True), 1, LORA, f"preference.reference={reference}")


def _live_equals_precomputed(live: PrefRun, precomputed: PrefRun) -> None:
    """The live run starts at ln 2 with zero rewards, leaves its reference, and every step's
    figures equal the precomputed run's within 1e-6."""
    _starts_at_ln2(live)
    assert live.metrics["rewards/margins"][-1] != 0  # the policy left the reference
    for name in COMPARED:
        scale = 1e-6 * np.abs(precomputed.metrics["logps/chosen"]).max()  # sums' float noise
        np.testing.assert_allclose(
            live.metrics[name], precomputed.metrics[name], rtol=1e-6, atol=scale, err_msg=name
        )


def test_live_reference_equals_precomputed_under_lora():
    """LoRA: the reference is the base with the adapters off, recomputed each step (live) or
    once before training (precomputed): the same numbers within 1e-6 over steps that move the
    adapters away from it."""
    live = _run(_lora_trainer("live"))  # 3 steps: the first at the warm-up's learning rate 0
    precomputed = _run(_lora_trainer("precomputed"))
    _live_equals_precomputed(live, precomputed)


def test_live_reference_equals_precomputed_under_full_finetuning(tmp_path):
    """Full fine-tuning: the live reference is a frozen copy of the starting parameters, held in
    the state beside the trained ones; its log-probabilities each step equal the precomputed
    ones within 1e-6 while the policy moves away, and step 0 is ln 2 with zero rewards. A
    checkpoint holds the copy: restored (resume, evaluate), it is the saved one bit for bit."""
    trainer = _trainer(ShardingPolicy(), 1, "preference.reference=live", devices=1)
    live, precomputed = _run(trainer), _one_device()
    _live_equals_precomputed(live, precomputed)
    state = trainer.init_state(seed=1)
    state = dataclasses.replace(state, reference=jax.tree.map(lambda p: p + 1, state.params))
    with Checkpointer(tmp_path, async_save=False) as checkpointer:
        checkpointer.save(state, checkpoint_meta(trainer, step=1, data_position=0))
        resumed = checkpointer.restore_state(None, restore_target(trainer)).state
        evaluated = restore_reference(trainer, checkpointer, 1)
    for copy in (reference_of(resumed), evaluated):
        for got, want in zip(
            jax.tree.leaves(copy), jax.tree.leaves(reference_of(state)), strict=True
        ):
            np.testing.assert_array_equal(got, want)


def _sft_twin(preference):
    """The supervised (chat SFT) trainer of ``preference``'s model, training settings and
    fine-tuning section, on the same mesh."""
    sft_class = get_job("llama/train/pretrain").trainer_class
    sections = ("training", "finetune")
    settings = [f"{section}.{key}={value}" for section in sections
                for key, value in getattr(preference.config, section).model_dump().items()
                if value is not None]  # fmt: skip
    config = apply_overrides(sft_class.config_class(model=PREF_MODEL), settings)
    return sft_class(config, preference.policy, preference.topology)


def test_preference_run_holds_no_second_model():
    """The model state of a preference run, planned (``theseus plan``'s totals) and as the
    trainer holds it, is the supervised run's of the same model and fine-tuning: LoRA with
    the live reference (the base with the adapters off, the costlier setting) a LoRA SFT run's,
    a full fine-tune with the precomputed reference a full SFT run's; no reference parameters
    either way. A full fine-tune with the live reference holds one parameter copy more. (A
    train step's arguments are its state and the batch: equal states, equal arguments.)"""
    shapes = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)  # noqa: E731
    lora = _lora_trainer("live")
    for preference in (lora, _trainer(ShardingPolicy(fsdp=True), 1)):
        sft = _sft_twin(preference)
        assert shapes(preference.abstract_state) == shapes(sft.abstract_state)
        planned = [
            plan(type(t), t.config, t.policy, 8, alternatives=False) for t in (preference, sft)
        ]
        assert planned[0].totals == planned[1].totals == preference.memory()
        assert planned[0].verdict.ok and planned[0].totals.params > 0
    # Full fine-tuning with the live reference: one frozen copy of the parameters more, created
    # in their storage layout (FSDP: sharded), and the plan counts it.
    live = _trainer(ShardingPolicy(fsdp=True), 1, "preference.reference=live")
    full = _trainer(ShardingPolicy(fsdp=True), 1)
    assert shapes(reference_of(live.abstract_state)) == shapes(live.abstract_state.params)
    assert reference_of(live.state_layout) == live.layouts.storage
    planned = [plan(type(t), t.config, t.policy, 8, alternatives=False) for t in (live, full)]
    copy = full.memory().params
    assert planned[0].totals == live.memory()
    assert planned[0].totals == dataclasses.replace(planned[1].totals, params=2 * copy)


# --- the job, end to end -------------------------------------------------------------------------


def write_pair_corpus(folder: Path, splits: dict[str, Any]) -> Path:
    """A preference corpus folder as ``theseus tokenize`` writes one (tokens, loss mask, example
    lengths per split; byte tokenizer; ``"kind": "preference"``) whose examples are the pairs of
    ``splits`` (split name -> MaskedExamples), chosen then rejected."""
    folder.mkdir()
    manifest = {"format": FORMAT, "kind": "preference", "vocab_size": PREF_MODEL.vocab_size,
                "token_dtype": "uint16", "loss_mask": True, "splits": {}}  # fmt: skip
    for split, examples in splits.items():
        np.asarray(examples.tokens, np.uint16).tofile(folder / f"{split}.bin")
        np.asarray(examples.mask, np.uint8).tofile(folder / f"{split}.mask")
        np.asarray(examples.lengths, np.uint32).tofile(folder / f"{split}.docs")
        shard = {"name": f"{split}.bin", "mask": f"{split}.mask", "docs": f"{split}.docs",
                 "tokens": int(examples.lengths.sum())}  # fmt: skip
        manifest["splits"][split] = {"shards": [shard]}
    (folder / "tokens.json").write_text(json.dumps(manifest))
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def _job_args(corpus: Path, out: Path, *extra: str) -> list:
    model = [f"model.{k}={v}" for k, v in PREF_MODEL.model_dump().items() if v is not None]
    model = [m for m in model if m.split("=")[0] in {f"model.{k}" for k in MODEL_FIELDS}]
    return [
        "train", "--job", PREF_JOB, "--fsdp", "--out", out, f"data.path={corpus}", *model,
        f"training.seq_len={SEQ_LEN}", "training.batch_size=8",
        "training.per_device_batch_size=1", "training.steps=4",
        "training.validation_interval=2", "training.validation_batches=1",
        "checkpointing.interval=2", "optimization.learning_rate=1e-3",
        "optimization.warmup_steps=1", *extra,
    ]  # fmt: skip


@functools.cache
def _pair_splits() -> dict[str, MaskedExamples]:
    """The test's pairs split: 40 train pairs, 16 validation pairs."""
    examples = _examples()
    cut = 2 * 40
    return {
        "train": MaskedExamples(examples.tokens[: examples.starts[cut]],
                                examples.mask[: examples.starts[cut]], examples.lengths[:cut]),
        "validation": MaskedExamples(examples.tokens[examples.starts[cut]:],
                                     examples.mask[examples.starts[cut]:], examples.lengths[cut:]),
    }  # fmt: skip


@pytest.fixture(scope="module")
def pair_corpus(tmp_path_factory) -> Path:
    return write_pair_corpus(tmp_path_factory.mktemp("pairs") / "corpus", _pair_splits())


def test_job_records_trl_metrics_and_resumes_bit_for_bit(pair_corpus, tmp_path):
    """``llama/train/preference`` from the CLI: every row carries TRL's metrics, validation rows
    ``val_``-prefixed ones and the preference loss as val_loss; the precomputed reference is
    stored in the run; a run resumed from step 2 reuses it and equals the uninterrupted run bit
    for bit; ``theseus evaluate RUN`` writes the same validation figures to eval.json."""
    run = tmp_path / "run"
    result = invoke(*_job_args(pair_corpus, run))
    assert result.exit_code == 0, result.output
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert abs(rows[0]["loss"] - math.log(2)) <= 1e-5
    for row in rows:
        assert set(METRICS) <= set(row)
    validated = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    assert all(f"val_{name}" in r for r in validated for name in METRICS)
    stored = run / REFERENCE_FILE
    assert stored.is_file()
    stamp = stored.stat().st_mtime_ns
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    result = invoke(*_job_args(pair_corpus, resumed, "--resume"))
    assert result.exit_code == 0, result.output
    assert "resumed from step 2" in result.output
    assert (resumed / REFERENCE_FILE).stat().st_mtime_ns == stamp  # read back, not recomputed
    again = read_metrics(resumed)
    keys = ("loss", "val_loss", *METRICS, *(f"val_{m}" for m in METRICS))
    for want, got in zip(rows, again, strict=True):
        assert {k: want.get(k) for k in keys} == {k: got.get(k) for k in keys}
    result = invoke("evaluate", run)  # the run's own pairs: its stored reference
    assert result.exit_code == 0, result.output
    evaluation = json.loads((run / "eval.json").read_text())
    assert evaluation["val_loss"] == pytest.approx(rows[-1]["val_loss"], rel=1e-5)
    for name in METRICS:
        want = rows[-1][f"val_{name}"]
        assert evaluation["metrics"][name] == pytest.approx(want, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize(
    "settings, fragments",
    [
        (["preference.beta=0"], ["preference.beta=0", "positive"]),
        (["preference.loss=simpo", "preference.reference=live"], ["reference-free"]),
        (["data.overlong=truncate"], ["data.overlong=truncate", "pairs"]),
        (["training.seq_len=15"], ["longer than a row", "data.overlong=drop"]),
    ],
)
def test_bad_settings_are_one_paragraph(settings, fragments, pair_corpus, tmp_path):
    result = invoke(*_job_args(pair_corpus, tmp_path / "run", *settings))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output
    assert not (tmp_path / "run").exists()


def _padded_ids(examples: MaskedExamples) -> np.ndarray:
    """The examples' ids, padded with 0 on the right: (examples, longest) int64."""
    ids = np.zeros((examples.lengths.size, int(examples.lengths.max())), np.int64)
    for row, (start, length) in enumerate(zip(examples.starts, examples.lengths, strict=True)):
        ids[row, :length] = examples.tokens[start : start + length]
    return ids


def _completion_logps(logits: np.ndarray, examples: MaskedExamples) -> np.ndarray:
    """Each example's summed completion log-probability (examples,) float64 from the logits
    (examples, longest, vocab) of its :func:`_padded_ids`."""
    ids, scores = _padded_ids(examples), logits.astype(np.float64)
    shifted = scores - scores.max(-1, keepdims=True)
    logps = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    out = np.zeros(ids.shape[0])
    for row, (start, length) in enumerate(zip(examples.starts, examples.lengths, strict=True)):
        predicted = logps[row, np.arange(length - 1), ids[row, 1:length]]  # (length - 1,)
        out[row] = (predicted * examples.mask[start + 1 : start + length]).sum()
    return out


def test_import_then_chat_sft_then_lora_dpo_exports_its_logits(imported, pair_corpus, tmp_path):
    """A fine-tuner's path: a transformers model imported, a chat SFT run (``llama/train/
    pretrain``) ``--init-from`` it, a LoRA DPO run ``--init-from`` that. The chat corpus is the
    pairs' examples without the manifest's preference kind, which the preference job refuses
    (no pairs) in one paragraph, exit 2, nothing written. The DPO run's reference is the SFT
    model (the adapters off): its stored log-probabilities are the SFT run's (from its logits,
    1e-5 relative) and its loss starts at ln 2; it moves away from it, and its merged export
    loads in transformers with the run's logits (1e-4)."""
    chat = tmp_path / "chat"
    shutil.copytree(pair_corpus, chat)
    manifest = json.loads((chat / "tokens.json").read_text())
    del manifest["kind"]
    (chat / "tokens.json").write_text(json.dumps(manifest))
    result = invoke(*_job_args(chat, tmp_path / "refused"))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output
    assert "is a chat corpus, not a preference corpus" in result.output, result.output
    assert not (tmp_path / "refused").exists()
    sft, run = tmp_path / "sft", tmp_path / "run"
    training = [f"training.seq_len={SEQ_LEN}", "training.batch_size=8",
                "training.per_device_batch_size=1", "training.validation_batches=1",
                "optimization.warmup_steps=1"]  # fmt: skip
    result = invoke("train", "--job", "llama/train/pretrain", "--init-from", imported("llama")[1],
                    "--out", sft, f"data.path={chat}", *training, "training.steps=2")  # fmt: skip
    assert result.exit_code == 0, result.output
    result = invoke("train", "--job", PREF_JOB, "--init-from", sft, "--out", run,
                    f"data.path={pair_corpus}", *training, "training.steps=3",
                    "finetune.lora_rank=4", "optimization.learning_rate=1e-2")  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = read_metrics(run)
    assert abs(rows[0]["loss"] - math.log(2)) <= 1e-5  # the adapters start at zero
    assert rows[-1]["rewards/margins"] != 0
    with np.load(run / REFERENCE_FILE) as held:
        (key,) = [k for k in held.files if k.endswith("/train")]
        stored = held[key].reshape(-1)
    train = _pair_splits()["train"]
    ids = _padded_ids(train)
    before = theseus.logits(sft, ids)
    np.testing.assert_allclose(stored, _completion_logps(before, train), rtol=1e-5)
    logits = theseus.logits(run, ids)
    assert np.abs(logits - before).max() > 1e-4
    merged = invoke("export-hf", run, tmp_path / "merged")
    assert merged.exit_code == 0, merged.output
    np.testing.assert_allclose(saved_logits(tmp_path / "merged", ids), logits, atol=1e-4, rtol=0)


def test_a_model_with_experts_adds_its_routing_loss():
    """``qwen3_moe/train/preference``: the step adds the load-balancing loss (weighted by the
    pairs) and records it beside TRL's metrics; ``loss`` is the preference loss alone (ln 2 at
    the reference, rewards 0)."""
    run = _run(_trainer(ShardingPolicy(), 1, devices=1, job=MOE_JOB), steps=2)
    _starts_at_ln2(run)
    assert set(METRICS) <= set(run.metrics) and (run.metrics["aux_loss"] > 0).all()
    load = run.metrics["expert_load"]  # (steps, experts)
    assert load.shape == (2, 4) and np.abs(load.sum(1) - 1).max() < 1e-5
