"""Online RL against TRL's own trainer: a tiny random transformers Llama imported by
``import-hf``, trained by ``llama/train/rl`` ``--init-from`` the import, and TRL 1.16's
``GRPOTrainer`` on the same transformers model fed theseus's own rollouts through its
``rollout_func`` (the prompt ids, completion ids and sampler log-probabilities of
``rollouts/1.jsonl``), with the same reward functions and settings.

TRL reads the prompts in the order theseus drew them (``shuffle_dataset=False``), so its
generation batch is theseus's row for row. Both sides take the same AdamW step (constant rate,
no weight decay, the same betas and epsilon, float32). Before any update (step 1) the rewards,
completion texts, advantages, old log-probabilities and the metrics both log agree to 1e-5
relative (texts, rewards and counts exactly; advantages and log-probabilities within 1e-6 where
near 0), the gradient norm to 1e-4; after it, a batch reused with its old
log-probabilities (ratios away from 1: tokens are clipped) gives TRL's loss, gradient norm and
token metrics to 1e-4 (the first AdamW step moves every weight by about the learning rate and
leaves the two sides' weights about 1e-6 apart, which moves the next losses by up to 1e-5).
Not compared: what one side alone logs (TRL's ``clip_ratio/low_min``, ``clip_ratio/high_max``,
``step_time`` and ``epoch``; theseus's ``sampling/*``, which TRL logs with vLLM only).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hf_reference import libraries
from support import trl_module

from theseus.config import apply_overrides
from theseus.execution import run_trainer
from theseus.hf.importer import import_hf
from theseus.jobs import get_job
from theseus.plot import read_metrics
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.run.evaluation import run_config
from theseus.training.run.mode import RunMode

TOKENIZER = Path(__file__).with_name("fixtures") / "digits_tokenizer"  # 0-9 + = <eot>=12 <unk>
END = 12
JOB = "llama/train/rl"
# Rewards with spread in the groups of a random model, in multiples of 1/8: exact in float32,
# TRL's dtype, so that a group of equal rewards leaves no rounding residue in TRL's deviation
# (theseus's, in float64, has none). ``digits`` reads the decoded text and returns None for an
# empty one (left out of the total, as TRL's nansum does).
REWARDS = '''
def ended(completion_ids, **kwargs):
    """1 for a completion that ends with the end token."""
    return [1.0 if ids[-1:] == [12] else 0.0 for ids in completion_ids]


def digits(completions, answer, **kwargs):
    """An eighth for each digit of the text, a quarter more where it holds the answer."""
    return [
        None if not text else sum(c.isdigit() for c in text) / 8 + (0.25 if a in text else 0.0)
        for text, a in zip(completions, answer)
    ]
'''
FUNCTIONS = ("ended", "digits")
WEIGHTS = (1.0, 0.5)
GENERATIONS = 4  # completions per prompt
BATCH = 16  # completions a step: one microbatch, one device
# The transformers model: 2 layers over the 14 tokens of the digits tokenizer (padded to 16),
# ending on its end token (TRL counts a completion ending there as terminated, as theseus does).
MODEL = dict(
    vocab_size=16,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=16,
    bos_token_id=None,
    eos_token_id=END,
    pad_token_id=None,
)
# The settings of both runs, by TRL's names.
BASE = dict(
    steps=1,
    seed=0,
    learning_rate=1e-2,
    max_grad_norm=1.0,
    temperature=0.8,
    loss_type="dapo",
    beta=0.0,
    epsilon=0.2,
    scale_rewards="group",
    num_iterations=1,
    steps_per_generation=1,
)
# The metrics of a generation batch: counts (exact) and the rest (1e-5).
COUNTS = (
    "num_tokens",
    "completions/min_length",
    "completions/max_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)
GENERATION = (
    "reward",
    "reward_std",
    *(f"rewards/{name}/{stat}" for name in FUNCTIONS for stat in ("mean", "std")),
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
)
# The metrics of an optimizer step (``kl`` too where beta > 0).
STEP = (
    "loss",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "learning_rate",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Ten distinct prompts ``a+b=`` of one length (TRL left-pads none) with their ``answer``
    (one held out), and the reward file."""
    folder = tmp_path_factory.mktemp("rl_trl_data")
    pairs = np.random.default_rng(3).choice(100, 10, replace=False)
    lines = [json.dumps({"prompt": f"{p // 10}+{p % 10}=", "answer": str(p // 10 + p % 10)})
             for p in pairs]  # fmt: skip
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "rewards.py").write_text(REWARDS)
    return folder


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random transformers Llama (float32) with the digits tokenizer, saved as a Hugging
    Face folder, and the theseus run that imports it."""
    lib = libraries()
    trl_module()  # a skip without the hf-reference extra (a failure under CI)
    torch, transformers = lib.torch, lib.transformers
    folder = tmp_path_factory.mktemp("rl_trl_model")
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    with torch.no_grad():
        for param in model.parameters():  # so that unit norms matter too
            param.normal_(0.0, 0.3)
    model.save_pretrained(folder / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / "hf" / name)
    import_hf(folder / "hf", folder / "run")
    return folder / "hf", folder / "run"


def theseus_run(out: Path, base: Path, data: Path, settings: dict) -> list[dict]:
    """``llama/train/rl`` ``--init-from`` the import on one device, in this process (its
    tokenizer the import's); its metrics rows."""
    job = get_job(JOB)
    config_class = job.trainer_class.config_class
    rewards = data / "rewards.py"
    overrides = [
        "training.seq_len=10",  # prompts of 4 tokens, completions of 6 at most
        f"training.batch_size={BATCH}",
        f"training.per_device_batch_size={BATCH}",
        f"training.steps={settings['steps']}",
        f"training.seed={settings['seed']}",
        "optimization.warmup_steps=0",
        "optimization.min_learning_rate_ratio=1.0",  # a constant rate, as TRL's "constant"
        f"optimization.learning_rate={settings['learning_rate']}",
        "optimization.weight_decay=0.0",
        "optimization.b1=0.9",
        "optimization.b2=0.999",  # torch's AdamW defaults
        "optimization.eps=1e-8",
        f"optimization.grad_clip={settings['max_grad_norm']}",
        "checkpointing.interval=100",
        "logging.progress_bar=false",
        f"data.path={data / 'prompts.jsonl'}",
        "data.validation_fraction=0.1",
        f"rl.rewards=[{rewards}:{FUNCTIONS[0]},{rewards}:{FUNCTIONS[1]}]",
        f"rl.reward_weights=[{WEIGHTS[0]},{WEIGHTS[1]}]",
        f"rl.num_generations={GENERATIONS}",
        "rl.max_completion_length=6",
        f"rl.temperature={settings['temperature']}",
        f"rl.loss={settings['loss_type']}",
        f"rl.beta={settings['beta']}",
        f"rl.epsilon={settings['epsilon']}",
        f"rl.scale_rewards={settings['scale_rewards']}",
        f"rl.num_iterations={settings['num_iterations']}",
        f"rl.steps_per_generation={settings['steps_per_generation']}",
    ]
    # A run started from another run's parameters has that run's model section.
    config = apply_overrides(config_class(model=run_config(config_class, base).model), overrides)
    policy = ShardingPolicy()
    trainer = job.trainer_class(config, policy, Topology.new(policy, devices=jax.devices()[:1]))
    run_trainer(job, trainer, out, mode=RunMode(init_from=base))
    return read_metrics(out)


def reward_functions(data: Path) -> list:
    """The reward file's functions, for TRL (theseus loads the same file itself)."""
    spec = importlib.util.spec_from_file_location("rl_trl_rewards", data / "rewards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [getattr(module, name) for name in FUNCTIONS]


def trl_run(hf: Path, data: Path, lines: list[dict], settings: dict, out: Path, monkeypatch):
    """TRL's GRPOTrainer on the transformers model in ``hf``, its rollouts theseus's ``lines``
    (through ``rollout_func``): its logged rows (one a step), what each
    ``_generate_and_score_completions`` returned, and its completion logs (texts, rewards,
    advantages)."""
    lib = libraries()
    trl = trl_module()
    torch, transformers = lib.torch, lib.transformers
    from datasets import Dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's experimental warning
    records = [json.loads(r) for r in (data / "prompts.jsonl").read_text().splitlines()]
    answers = {r["prompt"]: r["answer"] for r in records}
    prompts = [line["prompt"] for line in lines[::GENERATIONS]]  # theseus's, in its order
    dataset = Dataset.from_list([{"prompt": p, "answer": answers[p]} for p in prompts])

    def rollout_func(given: list[str], trainer) -> dict[str, list]:
        assert given == [line["prompt"] for line in lines]  # theseus's rows, in its order
        return {
            "prompt_ids": [line["prompt_ids"] for line in lines],
            "completion_ids": [line["completion_ids"] for line in lines],
            "logprobs": [line["logps"] for line in lines],
        }

    # A theseus step is one TRL optimizer step of one microbatch: TRL's steps_per_generation
    # (microbatches a generation feeds) is theseus's times its accumulation, 1.
    args = trl.GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        steps_per_generation=settings["steps_per_generation"],
        num_iterations=settings["num_iterations"],
        num_generations=GENERATIONS,
        max_completion_length=6,
        temperature=settings["temperature"],
        loss_type=settings["loss_type"],
        beta=settings["beta"],
        epsilon=settings["epsilon"],
        scale_rewards=settings["scale_rewards"],
        reward_weights=list(WEIGHTS),
        learning_rate=settings["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        max_grad_norm=settings["max_grad_norm"],
        max_steps=settings["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=settings["seed"],
        shuffle_dataset=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_functions(data),
        args=args,
        train_dataset=dataset,
        processing_class=transformers.AutoTokenizer.from_pretrained(hf),
        rollout_func=rollout_func,
    )
    scored: list[dict] = []
    generate_and_score = trainer._generate_and_score_completions

    def capture(inputs):
        output = generate_and_score(inputs)
        scored.append(output)
        return output

    trainer._generate_and_score_completions = capture
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, settings["steps"] + 1))
    return SimpleNamespace(rows=rows, scored=scored, logs=trainer._logs)


def both_runs(imported, data, tmp_path, monkeypatch, settings):
    """theseus's run, its rollouts' lines, and TRL's run on them."""
    hf, base = imported
    ours = theseus_run(tmp_path / "theseus", base, data, settings)
    path = tmp_path / "theseus" / "rollouts" / "1.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == BATCH * settings["steps_per_generation"]
    theirs = trl_run(hf, data, lines, settings, tmp_path / "trl", monkeypatch)
    return ours, lines, theirs


def assert_close(ours: dict, theirs: dict, names, *, rtol: float) -> None:
    for name in names:
        assert name in ours and name in theirs, name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=rtol, atol=0, err_msg=name)


def assert_same_generation(ours: dict, lines: list[dict], theirs) -> None:
    """Step 1's generation metrics, and per completion its text, rewards and advantage, are
    TRL's."""
    assert {name: ours[name] for name in COUNTS} == {name: theirs.rows[0][name] for name in COUNTS}
    assert_close(ours, theirs.rows[0], GENERATION, rtol=1e-5)
    assert [line["completion"] for line in lines] == list(theirs.logs["completion"])
    for name in FUNCTIONS:
        want = np.asarray(theirs.logs["rewards"][name], np.float64)  # NaN where None
        got = [line["rewards"][name] for line in lines]
        got = [math.nan if value is None else value for value in got]
        np.testing.assert_array_equal(got, want, err_msg=name)
    advantages = theirs.scored[0]["advantages"].numpy()
    assert np.abs(advantages).max() > 0.1  # the groups have spread
    np.testing.assert_allclose([line["advantage"] for line in lines], advantages, rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_one_step_equals_trl(imported, data, tmp_path, monkeypatch):
    """One step (TRL's defaults: dapo, no KL, each batch trained once): the rewards, completion
    texts, advantages, generation and step metrics equal TRL's logged ones (1e-5, counts
    exactly), the gradient norm before clipping (theseus's global norm of the mean gradient,
    transformers' ``clip_grad_norm_`` total) to 1e-4."""
    settings = dict(BASE)
    ours, lines, theirs = both_runs(imported, data, tmp_path, monkeypatch, settings)
    (row,) = ours
    assert_same_generation(row, lines, theirs)
    assert "old_per_token_logps" not in theirs.scored[0]  # ratios are 1: old = current
    assert_close(row, theirs.rows[0], STEP, rtol=1e-5)
    assert abs(row["loss"]) > 1e-3  # dapo's token-weighted advantages, away from 0
    assert_close(row, theirs.rows[0], ("grad_norm",), rtol=1e-4)


REUSES = {  # a generation batch trained by two optimizer steps
    # twice on one batch, the grpo loss with a KL to the reference and gradients clipped
    "num_iterations": dict(
        BASE, steps=2, num_iterations=2, loss_type="grpo", beta=0.04, max_grad_norm=0.5,
        scale_rewards="batch",
    ),
    # one batch of 32 completions split over two steps (TRL's shuffle before the split is
    # patched to the identity, so its steps read theseus's halves)
    "steps_per_generation": dict(BASE, steps=2, steps_per_generation=2),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REUSES))
def test_a_reused_batch_equals_trl(imported, data, tmp_path, monkeypatch, case):
    """A generation batch two steps read: its old log-probabilities equal TRL's (1e-5); step 1
    equals TRL's as one step does; after the same AdamW update, step 2 (ratios away from 1:
    tokens clipped) has TRL's loss, gradient norm and token metrics (1e-4)."""
    trl = trl_module()
    settings = REUSES[case]
    if settings["steps_per_generation"] > 1:
        monkeypatch.setattr(trl.trainer.grpo_trainer, "shuffle_sequence_dict", lambda rows: rows)
    ours, lines, theirs = both_runs(imported, data, tmp_path, monkeypatch, settings)
    assert len(theirs.scored) == 1  # one generation for both steps
    assert_same_generation(ours[0], lines, theirs)
    (scored,) = theirs.scored
    mask = scored["completion_mask"].numpy().astype(bool)
    old = scored["old_per_token_logps"].numpy()[mask]
    np.testing.assert_allclose(np.concatenate([line["old_logps"] for line in lines]), old,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    step = (*STEP, "kl") if settings["beta"] else STEP
    first, second = (dict(row) for row in ours)
    if settings["loss_type"] == "grpo":  # the mean advantage at ratio 1: 0 but for rounding
        assert abs(first.pop("loss")) < 1e-6 and abs(theirs.rows[0]["loss"]) < 1e-6
        step_one = tuple(name for name in step if name != "loss")
    else:
        step_one = step
    assert_close(first, theirs.rows[0], step_one, rtol=1e-5)
    assert_close(first, theirs.rows[0], ("grad_norm",), rtol=1e-4)
    assert second["clip_ratio/region_mean"] > 0  # ratios outside [0.8, 1.2]
    assert second["sampling/importance_sampling_ratio/mean"] != pytest.approx(1, abs=1e-3)
    assert_close(second, theirs.rows[1], (*step, "grad_norm"), rtol=1e-4)
