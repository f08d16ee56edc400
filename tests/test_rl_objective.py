"""The GRPO family's objective (theseus/posttraining/rl/objective.py) against TRL 1.16's own
GRPOTrainer code on the same numbers (float32): its ``_compute_loss`` on a stand-in trainer whose
model returns the test's log-probabilities, its gradient by torch autograd, the metrics it logs,
and its advantages."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import libraries
from support import trl_module

from theseus.posttraining.rl.objective import (
    ObjectiveSettings,
    aggregation_weights,
    group_advantages,
    metric_weights,
    token_terms,
)

NUM_GENERATIONS = 3
ROWS, WIDTH = 12, 7  # a generation batch of 4 prompts × 3 completions, 7 completion positions
MAX_COMPLETION_LENGTH = 11
LENGTHS = np.array([7, 1, 2, 5, 0, 6, 3, 7, 1, 4, 2, 6])  # one empty (a masked truncation)
MASK = (np.arange(WIDTH) < LENGTHS[:, None]).astype(np.int64)  # (rows, width)
RNG = np.random.default_rng(52)  # clips at both levels, below and above, and past delta
LOGPS = -RNG.uniform(0.05, 3.0, (ROWS, WIDTH)).astype(np.float32)
OLD_LOGPS = (LOGPS + RNG.uniform(-0.6, 0.6, (ROWS, WIDTH))).astype(np.float32)  # ratios ≠ 1
REF_LOGPS = (LOGPS + RNG.uniform(-0.5, 0.5, (ROWS, WIDTH))).astype(np.float32)
ENTROPIES = RNG.uniform(0.1, 4.0, (ROWS, WIDTH)).astype(np.float32)
# The second prompt's completions all score 1 (no signal); one completion is unscorable.
REWARDS = np.array([0.3, 1.2, -0.4, 1, 1, 1, np.nan, 0.7, 0.1, 2.0, 0.0, 0.5])
# (steps, accumulation): one microbatch; two accumulated; two optimizer steps per generation
# batch (dapo and cispo normalize by the whole batch's tokens); both.
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]
CLIPPED = ["grpo", "bnpo", "dr_grpo", "dapo"]
CASES = [
    (loss, sampling, beta, delta)
    for loss, sampling, beta in itertools.product(
        [*CLIPPED, "cispo"], ["token", "sequence"], [0.0, 0.04]
    )
    for delta in ([None, 1.5] if loss in CLIPPED else [None])
]


def _settings(loss: str, sampling: str, beta: float, delta: float | None) -> ObjectiveSettings:
    return ObjectiveSettings(
        loss=loss,
        importance_sampling=sampling,
        epsilon=0.2,
        epsilon_high=1.3 if loss == "cispo" else 0.28,  # cispo's cap on the ratio itself
        delta=delta,
        beta=beta,
        kl_bias_correction=True,
    )


def _trl_stub(torch, settings: ObjectiveSettings, *, steps: int, accumulation: int):
    """A GRPOTrainer with only what ``_compute_loss`` reads: one process, training mode, no
    vLLM, no entropy mask or bonus, no off-policy mask, no auxiliary loss."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    identity = lambda tensor, **kwargs: tensor  # noqa: E731 (one process)
    trainer = object.__new__(GRPOTrainer)
    fields = dict(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(
            num_processes=1, reduce=identity, gather=identity, gather_for_metrics=identity,
            sync_gradients=True,
        ),
        args=SimpleNamespace(
            use_bias_correction_kl=settings.kl_bias_correction,
            delta=settings.delta,
            steps_per_generation=steps * accumulation,
        ),
        loss_type=settings.loss,
        importance_sampling_level=settings.importance_sampling,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        beta=settings.beta,
        max_completion_length=MAX_COMPLETION_LENGTH,
        current_gradient_accumulation_steps=accumulation,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )  # fmt: skip
    for name, value in fields.items():
        setattr(trainer, name, value)
    return trainer


def _trl_steps(torch, settings: ObjectiveSettings, advantages: np.ndarray, *, steps, accumulation):
    """TRL on the generation batch split into ``steps`` × ``accumulation`` microbatches, in row
    order, as its trainer feeds them: each step's loss (its microbatches' losses summed, as
    their gradients accumulate), d loss / d logps (rows, width), and each step's logged metrics
    (the mean of its microbatches' values, as ``GRPOTrainer.log`` takes them)."""
    trainer = _trl_stub(torch, settings, steps=steps, accumulation=accumulation)
    rows = ROWS // (steps * accumulation)
    num_items = torch.tensor(MASK.sum())  # gathered over the generation batch
    losses, grads, metrics = [], [], []
    for step in range(steps):
        total = 0.0
        trainer._metrics["train"].clear()
        for micro in range(accumulation):
            batch = slice(
                (step * accumulation + micro) * rows, (step * accumulation + micro + 1) * rows
            )
            logps = torch.tensor(LOGPS[batch], requires_grad=True)
            entropies = torch.tensor(ENTROPIES[batch])
            trainer._get_per_token_logps_and_entropies = (
                lambda *args, logps=logps, entropies=entropies, **kwargs: (logps, entropies, None)
            )
            inputs = {
                "prompt_ids": torch.zeros((rows, 2), dtype=torch.long),
                "prompt_mask": torch.ones((rows, 2), dtype=torch.long),
                "completion_ids": torch.zeros((rows, WIDTH), dtype=torch.long),
                "completion_mask": torch.tensor(MASK[batch]),
                "advantages": torch.tensor(advantages[batch]),
                "old_per_token_logps": torch.tensor(OLD_LOGPS[batch]),
                "num_items_in_batch": num_items,
            }
            if settings.beta != 0.0:
                inputs["ref_per_token_logps"] = torch.tensor(REF_LOGPS[batch])
            loss = trainer._compute_loss(None, inputs)
            loss.backward()
            total += float(loss.detach())
            grads.append(logps.grad.numpy())
        losses.append(total)
        metrics.append({k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()})
    return losses, np.concatenate(grads), metrics


@pytest.fixture(scope="module")
def torch():
    trl_module()  # a skip without the hf-reference extra (a failure under CI)
    return libraries().torch


@pytest.mark.parametrize(
    "loss,sampling,beta,delta",
    CASES,
    ids=[f"{c[0]}-{c[1]}-beta{c[2]}-delta{c[3]}" for c in CASES],
)
def test_loss_gradient_and_metrics_equal_trl(torch, loss, sampling, beta, delta):
    """Each optimizer step's loss, its gradient in the policy's log-probabilities (1e-6), and
    the kl, clip and entropy metrics TRL logs, for every layout of steps and accumulation."""
    settings = _settings(loss, sampling, beta, delta)
    advantages = group_advantages(REWARDS, NUM_GENERATIONS, "group").advantages
    mask = jnp.asarray(MASK, jnp.float32)
    ref = jnp.asarray(REF_LOGPS) if beta else None

    def per_token_loss(logps):
        terms = token_terms(
            settings, logps, jnp.asarray(OLD_LOGPS), ref, jnp.asarray(advantages), mask
        )
        return terms.loss, terms

    values, backward, terms = jax.vjp(per_token_loss, jnp.asarray(LOGPS), has_aux=True)
    values = np.asarray(values, np.float64)  # (rows, width)
    for steps, accumulation in LAYOUTS:
        layout = dict(steps=steps, accumulation=accumulation)
        want_losses, want_grad, want_metrics = _trl_steps(torch, settings, advantages, **layout)
        weights = aggregation_weights(
            loss, MASK, max_completion_length=MAX_COMPLETION_LENGTH, **layout
        )
        (grad,) = backward(jnp.asarray(weights, jnp.float32))
        np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6, err_msg=str(layout))
        tokens = metric_weights(MASK, **layout)
        sequences = metric_weights(MASK, per_sequence=sampling == "sequence", **layout)
        ours = {"entropy": (tokens, ENTROPIES)}
        if beta:
            ours["kl"] = (tokens, terms.kl)
        if loss == "cispo":
            ours["cispo_clip_ratio"] = (sequences, terms.high_clipped)
        else:
            ours |= {
                f"clip_ratio/{name}_mean": (sequences, getattr(terms, f"{name}_clipped"))
                for name in ("low", "high", "region")
            }
        for step, (want_loss, want) in enumerate(zip(want_losses, want_metrics, strict=True)):
            rows = slice(step * ROWS // steps, (step + 1) * ROWS // steps)
            got = float(np.sum(weights[rows] * values[rows]))
            assert abs(got - want_loss) <= 1e-6, (layout, step, got, want_loss)
            for name, (w, value) in ours.items():
                got = float(np.sum(w[rows] * np.asarray(value, np.float64)[rows]))
                assert abs(got - want[name]) <= 1e-6, (layout, step, name, got, want[name])
            assert set(ours) <= set(want)
    if delta is None and not beta:  # the test's ratios clip, below and above
        for name in ("high",) if loss == "cispo" else ("low", "high"):
            clipped = np.asarray(getattr(terms, f"{name}_clipped"))  # (rows, width)
            if sampling == "sequence":
                assert clipped[:, 0].any(), name
            else:
                assert (clipped * MASK).any(), name


def _trl_advantages(torch, rewards: np.ndarray, num_generations: int, scale: str):
    """TRL 1.16's advantages, ``GRPOTrainer._generate_and_score_completions`` from its rewards
    on (``multi_objective_aggregation="sum_then_normalize"``, one process), with two reward
    functions: the first scores every completion the second does not (None, NaN to TRL), the
    second returns None for every completion whose reward is NaN here. That code is inline in
    the method; these are its lines, with TRL's own ``nanstd``."""
    from trl.trainer.utils import nanstd

    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    second = torch.where(torch.arange(len(rewards)) % 2 == 0, rewards_t, math.nan)
    first = torch.where(torch.arange(len(rewards)) % 2 == 0, math.nan, rewards_t)
    rewards_per_func = torch.stack([first, second], dim=1)  # (completions, functions)
    reward_weights = torch.ones(2)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    summed = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    summed[unscorable_mask] = torch.nan
    mean_grouped = torch.nanmean(summed.view(-1, num_generations), dim=1)
    mean_grouped = mean_grouped.repeat_interleave(num_generations, dim=0)
    if scale in ["group", "none"]:
        if num_generations > 1:
            std = nanstd(summed.view(-1, num_generations), dim=1)
            std = std.repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(summed)
    else:
        std = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
    advantages = summed - mean_grouped
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    logged = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    logged[unscorable_mask] = torch.nan
    metrics = {
        "reward": torch.nanmean(logged).item(),
        "reward_std": nanstd(logged).item(),
        "frac_reward_zero_std": is_std_zero.float().mean().item(),
    }
    return advantages.numpy(), metrics


ADVANTAGE_REWARDS = np.array(
    [0.3, 1.2, -0.4, 1, 1, 1, np.nan, 0.7, 0.1, np.nan, np.nan, 0.5, np.nan, np.nan, np.nan]
)  # a group with no signal, one with an unscorable completion, one scored once, none scored


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(torch, scale):
    """Advantages and reward metrics, NaN rewards (every reward function returned None)
    included; groups of 3, of 5 and of 1 (TRL's evaluation with one generation)."""
    for num_generations in (3, 5, 1):
        got = group_advantages(ADVANTAGE_REWARDS, num_generations, scale)
        want, metrics = _trl_advantages(torch, ADVANTAGE_REWARDS, num_generations, scale)
        assert got.advantages.dtype == np.float32
        np.testing.assert_allclose(got.advantages, want, rtol=1e-6, atol=1e-6)
        for name, value in metrics.items():
            np.testing.assert_allclose(getattr(got, name), value, rtol=1e-6, err_msg=name)
    groups = group_advantages(ADVANTAGE_REWARDS, 3, scale).group_std
    assert groups[3:6].tolist() == [0.0] * 3 and np.isnan(groups[9:]).all()


def test_inputs_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="steps=2 × accumulation=4"):
        aggregation_weights("dapo", MASK, steps=2, accumulation=4, max_completion_length=7)
    with pytest.raises(ValueError, match="num_generations=5"):
        group_advantages(REWARDS, 5, "group")
    with pytest.raises(ValueError, match="needs reference"):
        settings = ObjectiveSettings(beta=0.1)
        token_terms(settings, *(jnp.asarray(LOGPS),) * 2, None, jnp.zeros(ROWS), MASK)
