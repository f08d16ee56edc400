"""Online RL (``NAME/train/rl``): rollouts on the training mesh that every layout draws alike,
the run's records (rollouts, TRL's metrics), resume inside a generation batch, bad input.

The losses against TRL's own code are tests/test_rl_objective.py's; prompts and rewards are
tests/test_rl_rewards.py's."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from support import LOSS_RTOL, invoke, policy_id, subprocess_env

from theseus.config import apply_overrides
from theseus.execution import run_trainer
from theseus.inference.generator import Generator
from theseus.jobs import get_job
from theseus.plot import read_metrics
from theseus.posttraining.rl.rows import cut_at_end
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.run.mode import RunMode
from theseus.training.run.stops import Preempted

TOKENIZER = Path(__file__).with_name("fixtures") / "digits_tokenizer"  # 0-9 + = <eot>=12 <unk>
END = 12
JOB = "llama/train/rl"
REWARD = '''
def modular_sum(prompts, completions, completion_ids, answer, **kwargs):
    """1 for the answer's digit then the end token; 0.5 for the digit alone."""
    return [
        1.0 if ids == [int(a), 12] else 0.5 if ids[:1] == [int(a)] else 0.0
        for ids, a in zip(completion_ids, answer)
    ]
'''
# A Llama of 2 layers over the 14 tokens of the digits tokenizer (the vocabulary padded to 16,
# so that 8 devices divide it); 4 prompts × 4 completions a step.
SETTINGS = (
    "model.vocab_size=16",
    "model.hidden_size=24",
    "model.intermediate_size=40",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=8",
    "model.max_position_embeddings=16",
    "training.seq_len=13",
    "training.batch_size=16",
    "training.steps=3",
    "training.validation_interval=2",
    "optimization.warmup_steps=0",
    "optimization.learning_rate=1e-3",
    "checkpointing.interval=1",
    "logging.progress_bar=false",
    "rl.num_generations=4",
    "rl.max_completion_length=6",
    "rl.num_iterations=2",
    "data.validation_fraction=0.2",
)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[Path, Path]:
    """A prompt file of ``a+b=`` records with their ``answer``, and a reward file."""
    folder = tmp_path_factory.mktemp("rl_data")
    rng = random.Random(0)
    lines = []
    for _ in range(20):
        a, b = rng.randrange(10), rng.randrange(10)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)}))
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "rewards.py").write_text(REWARD)
    return folder / "prompts.jsonl", folder / "rewards.py"


def rl_settings(prompts: tuple[Path, Path], *more: str) -> list[str]:
    path, rewards = prompts
    return [
        *SETTINGS,
        f"data.path={path}",
        f"rl.tokenizer={TOKENIZER}",
        f"rl.rewards=[{rewards}:modular_sum]",
        *more,
    ]


def run_rl(out: Path, settings: list[str], policy: ShardingPolicy, num_devices: int, **mode):
    """An RL run in this process on the first ``num_devices`` devices; its trainer."""
    job = get_job(JOB)
    config = apply_overrides(job.trainer_class.config_class(), settings)
    topology = Topology.new(policy, devices=jax.devices()[:num_devices])
    trainer = job.trainer_class(config, policy, topology)
    run_trainer(job, trainer, out, mode=RunMode(**mode))
    return trainer


def rollouts(run: Path) -> dict[int, list[list[int]]]:
    """Each generation's completions (token ids), by first step."""
    found = {}
    for path in sorted((run / "rollouts").glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        found[int(path.stem)] = [line["completion_ids"] for line in lines]
    return found


#: The generation programs the reference run built (batch shapes), one per compilation.
REFERENCE_PROGRAMS: list[tuple] = []


@pytest.fixture(scope="module")
def reference(prompts, tmp_path_factory) -> Path:
    """The one-device run every layout is compared with (the generation programs it compiles
    counted in REFERENCE_PROGRAMS)."""
    out = tmp_path_factory.mktemp("rl_one") / "run"
    settings = rl_settings(prompts, "training.per_device_batch_size=16")
    original = Generator._programs_for

    def counted(self, *key):
        REFERENCE_PROGRAMS.append(key)
        return original(self, *key)

    Generator._programs_for = counted  # type: ignore[method-assign]
    try:
        run_rl(out, settings, ShardingPolicy(), 1)
    finally:
        Generator._programs_for = original  # type: ignore[method-assign]
    return out


LAYOUTS = [  # (policy, per-device batch): 16 completions, accumulation 2 under tp=2 + FSDP
    (ShardingPolicy(zero=False), 2),
    (ShardingPolicy(), 2),
    (ShardingPolicy(fsdp=True), 2),
    (ShardingPolicy(tp=2, fsdp=True), 2),
    (ShardingPolicy(tp=4, fsdp=True), 8),
]


@pytest.mark.parametrize(("policy", "per_device"), LAYOUTS, ids=[policy_id(p) for p, _ in LAYOUTS])
def test_every_layout_draws_the_same_completions(prompts, reference, tmp_path, policy, per_device):
    """DP, ZeRO, FSDP, tp=2 + FSDP with accumulation 2 and tp=4 + FSDP on 8 devices draw one
    device's completions token for token (a generation batch trained twice, rl.num_iterations=2,
    then one drawn from the trained model) and give its losses within 1e-5."""
    out = tmp_path / "run"
    run_rl(out, rl_settings(prompts, f"training.per_device_batch_size={per_device}"), policy, 8)
    assert rollouts(out) == rollouts(reference)
    got, want = read_metrics(out), read_metrics(reference)
    assert [r["step"] for r in got] == [1, 2, 3]
    for name in ("loss", "grad_norm", "entropy", "reward"):
        np.testing.assert_allclose(
            [r[name] for r in got], [r[name] for r in want], rtol=LOSS_RTOL, err_msg=name
        )


def test_two_processes_draw_one_devices_completions(prompts, reference, tmp_path):
    """`theseus launch -n 2` (2 processes × 4 devices, tp=2 + FSDP, accumulation 2): process 0
    writes the rollouts, which are one device's token for token, and the losses are its own
    within 1e-5."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "theseus", "launch", "-n", "2", "--cpu-devices-per-process", "4",
        "--", "train", "--job", JOB, "--out", str(out), "--tp", "2", "--fsdp",
        *rl_settings(prompts, "training.per_device_batch_size=2"),
    ]  # fmt: skip
    result = subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert rollouts(out) == rollouts(reference)
    got, want = read_metrics(out), read_metrics(reference)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=LOSS_RTOL)


def test_the_run_keeps_its_rollouts_and_trl_metrics(reference):
    """Every generation batch is in rollouts/<first step>.jsonl, one completion a line; the rows
    carry TRL's metric names; a second step on the same batch has ratios away from 1."""
    lines = [
        json.loads(line) for line in (reference / "rollouts" / "1.jsonl").read_text().splitlines()
    ]
    assert len(lines) == 16
    first = lines[0]
    assert set(first) == {
        "prompt", "completion", "prompt_ids", "completion_ids", "rewards", "reward",
        "advantage", "logps", "old_logps",
    }  # fmt: skip
    for line in lines:
        ids = line["completion_ids"]
        assert END not in ids[:-1] and len(ids) <= 6  # cut after the first end token
        assert len(line["logps"]) == len(ids) == len(line["old_logps"])
        assert line["completion"] == "".join(
            str(i) if i < 10 else "+="[i - 10] for i in ids if i < END
        )
    rows = read_metrics(reference)
    for name in (
        "reward", "reward_std", "rewards/modular_sum/mean", "rewards/modular_sum/std",
        "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
        "completions/mean_terminated_length", "entropy", "clip_ratio/region_mean",
        "num_tokens", "loss", "grad_norm", "learning_rate",
    ):  # fmt: skip
        assert all(name in row for row in rows), name
    assert "val_reward" in rows[1] and "val_reward" in rows[2]
    assert rows[0]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1, abs=1e-5)
    assert sorted(rollouts(reference)) == [1, 3]  # steps 1 and 2 train on one batch
    # Two generation batches and three held-out generations: one compiled prefill and step.
    assert len(REFERENCE_PROGRAMS) == 1, REFERENCE_PROGRAMS
    assert all(row["rollout/tokens_per_s"] > 0 for row in rows)


PREEMPTING = (
    REWARD
    + '''

import os
import signal
from pathlib import Path


def preempting_sum(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
    """modular_sum, and a SIGTERM to this process while step 1's rollout is scored, once."""
    marker = Path(__file__).with_name("preempt-once")
    if trainer_state.global_step == 1 and marker.exists():
        marker.unlink()
        os.kill(os.getpid(), signal.SIGTERM)
    return modular_sum(prompts, completions, completion_ids, answer)
'''
)


def test_a_sigterm_inside_a_generation_batch_resumes_bit_for_bit(prompts, reference, tmp_path):
    """A SIGTERM while step 1's rollout is scored: step 1 is finished and saved; the resumed run
    trains step 2 on step 1's generation batch, read back from rollouts/1.jsonl (its old
    log-probabilities included), and draws step 3's: every number of the uninterrupted run, bit
    for bit."""
    rewards = tmp_path / "preempting.py"
    rewards.write_text(PREEMPTING)
    (tmp_path / "preempt-once").touch()
    settings = rl_settings(
        prompts, "training.per_device_batch_size=16", f"rl.rewards=[{rewards}:preempting_sum]"
    )
    out = tmp_path / "run"
    with pytest.raises(Preempted, match="finished step 1 of 3"):
        run_rl(out, settings, ShardingPolicy(), 1)
    assert sorted(rollouts(out)) == [1]
    run_rl(out, settings, ShardingPolicy(), 1, resume=True)
    assert rollouts(out) == rollouts(reference)
    timing = {"step_time_s", "tokens_per_s", "trained_tokens_per_s", "mfu"}
    timing |= {"rollout/generate_s", "rollout/score_s", "rollout/tokens_per_s"}

    def numbers(run: Path) -> list[dict]:
        return [
            {
                k.replace("preempting_sum", "modular_sum"): v
                for k, v in row.items()
                if k not in timing
            }
            for row in read_metrics(run)
        ]

    assert numbers(out) == numbers(reference)


def test_lora_scores_its_reference_with_the_adapters_off(prompts, reference, tmp_path):
    """A LoRA run --init-from a run, with a KL to its reference (rl.beta > 0): the reference is
    the base with the adapters off, so the state holds the base once; the KL is 0 while the
    adapters are (zero-initialised), and grows once they train."""
    settings = rl_settings(
        prompts,
        "training.per_device_batch_size=16",
        "finetune.lora_rank=4",
        "rl.beta=0.04",
        "rl.num_iterations=1",
        "optimization.learning_rate=1e-2",
    )
    out = tmp_path / "lora"
    trainer = run_rl(out, settings, ShardingPolicy(), 1, init_from=reference)
    assert not trainer.holds_reference
    kls = [row["kl"] for row in read_metrics(out)]
    assert kls[0] == 0 and kls[1] > 0 and kls[2] > 0, kls


def test_a_family_with_experts_adds_its_routing_loss(prompts, tmp_path):
    """qwen3_moe/train/rl: the step adds the load-balancing loss to the RL objective and
    records it beside TRL's metrics."""
    job = get_job("qwen3_moe/train/rl")
    settings = [
        s for s in rl_settings(prompts, "training.per_device_batch_size=16") if "num_kv" not in s
    ]
    moe = ["model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=16"]
    config = apply_overrides(
        job.trainer_class.config_class(), [*settings, *moe, "training.steps=1"]
    )
    topology = Topology.new(ShardingPolicy(), devices=jax.devices()[:1])
    trainer = job.trainer_class(config, ShardingPolicy(), topology)
    run_trainer(job, trainer, tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    assert row["aux_loss"] > 0 and "expert_load" in row and "reward" in row


def test_completions_stop_at_the_first_end_id():
    new = np.asarray([[3, 12, 5, 12], [4, 4, 4, 4], [12, 1, 1, 1]])
    logps = -np.arange(12, dtype=np.float32).reshape(3, 4)
    cut = cut_at_end([[1], [2], [3]], new, logps, (12, 13))
    assert cut.ids == [[3, 12], [4, 4, 4, 4], [12]]
    assert cut.sampler_logps == [[0.0, -1.0], [-4.0, -5.0, -6.0, -7.0], [-8.0]]
    assert cut.terminated.tolist() == [True, False, True]


def test_bad_input_is_one_paragraph_and_exit_2(prompts, tmp_path):
    """A batch that is not a multiple of the group, a prompt file without ``prompt``, a reward
    that does not exist: exit 2, one paragraph, nothing written."""
    no_prompt = tmp_path / "bad.jsonl"
    no_prompt.write_text(json.dumps({"question": "1+1="}) + "\n")
    cases = [
        (["rl.num_generations=3"], "multiple of rl.num_generations=3"),
        ([f"data.path={no_prompt}"], "prompt"),
        (["rl.rewards=[nowhere.py:f]"], "nowhere.py"),
        (["rl.max_completion_length=13"], "rl.max_completion_length=13"),
    ]
    for more, fragment in cases:
        out = tmp_path / "run"
        result = invoke(
            "train", "--job", JOB, "--out", out, *rl_settings(prompts, *more),
            "training.per_device_batch_size=2",
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        assert fragment in result.output and "Traceback" not in result.output, result.output
        assert not out.exists()
