"""Long runs that lose nothing: non-finite steps stop or are skipped, resuming with changed
settings is checked, a failed save stops the run and keeps the committed checkpoints, and
metrics.jsonl is strict JSON. (SIGTERM is tested with the SIGKILL test in test_cli.py and with two
processes in test_multiprocess.py.)"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import TINY_GPT, GPTTrainer, GPTTrainerConfig, invoke, log_lines, shared_trainer

from theseus.checkpoint.checkpointer import Checkpointer, CheckpointWriteError
from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import apply_overrides
from theseus.data import Sampler, load_corpus
from theseus.sharding.axis import ShardingPolicy
from theseus.training.run import dashboards
from theseus.training.run.checkpointing import restore_target
from theseus.training.run.dashboards import GuardedDashboard
from theseus.training.run.loop import train
from theseus.training.run.preemption import PreemptionWatch
from theseus.training.run.start import check_resume, resume_changes
from theseus.training.run.stops import NonFiniteError
from theseus.training.state import TrainState

DIVERGING = (
    "optimization.learning_rate=1e4",
    "optimization.warmup_steps=0",
    "optimization.grad_clip=1e9",
)


def strict_rows(run_dir):
    """metrics.jsonl read by a strict JSON parser (NaN and Infinity are errors)."""

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=reject) for line in lines]


def config(*overrides):
    return apply_overrides(GPTTrainerConfig(), [*TINY_GPT, *overrides])


# --- non-finite steps --------------------------------------------------------------------------


def test_diverging_run_stops_and_resumes_from_the_newest_good_checkpoint(tmp_path):
    """A learning rate of 10,000 makes a step's gradient non-finite within a few steps (which
    one, and whether inf or nan, depends on how XLA rounds values near float32's limit, so the
    test reads it from the stop; at the issue's 100 the loss reached 4e9 in 10 steps without
    overflowing once the written-out attention masked by adding -inf); it stops there, exit 3, nothing saved after the
    step before; a resume that lowers the learning rate is refused, then accepted with
    --allow-changes (skipping what still overflows). (--steps extends a run without it: the
    README's own-text run, tests/test_readme.py.)"""
    out = tmp_path / "nan"
    diverging = (*DIVERGING, "checkpointing.interval=1")
    result = invoke("train", "--out", out, *TINY_GPT, *diverging, "--steps", 10)
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    stopped = result.stderr
    assert stopped.startswith("stopped: ") and stopped.count("\n") == 1  # one paragraph
    found = re.match(r"stopped: step (\d+): grad_norm is (nan|inf);", stopped)
    assert found, stopped
    first = int(found.group(1))
    good = first - 1
    assert good >= 1, stopped
    assert f"{out / 'checkpoints' / str(good)} (step {good})" in stopped
    assert max(int(p.name) for p in (out / "checkpoints").iterdir()) == good
    rows = strict_rows(out)
    assert [r["step"] for r in rows] == list(range(1, first + 1))  # stopped within one step
    assert rows[-1]["grad_norm"] is None and rows[-1]["skipped"] is True
    assert not any(r["skipped"] for r in rows[:-1])

    # The newest good weights already sit at float32's limit, so the resumed run skips the
    # steps whose gradients still overflow rather than stopping at them.
    lower = ("optimization.learning_rate=1e-3", "training.nonfinite=skip")
    refused = invoke(
        "train", "--out", out, *TINY_GPT, *diverging, *lower, "--steps", 10, "--resume"
    )
    assert refused.exit_code == 2, refused.output
    assert "optimization.learning_rate: 10000.0 -> 0.001" in refused.output
    assert "--allow-changes" in refused.output

    # Saved every 5 steps from here (every step above, to stop on the step before): a save costs
    # more CPU than a tiny step, and the interval is a setting a resume may change.
    args = [*TINY_GPT, *diverging, *lower, "training.max_skipped_steps=20", "--resume"]
    args += ["checkpointing.interval=5"]
    resumed = invoke("train", "--out", out, *args, "--allow-changes", "--steps", 10)
    assert resumed.exit_code == 0, resumed.output
    assert f"resumed from step {good}" in resumed.output
    assert [r["step"] for r in strict_rows(out)] == list(range(1, 11))
    (resume,) = json.loads((out / "run.json").read_text())["resumes"]
    assert resume["from_step"] == good
    assert {"key": "optimization.learning_rate", "old": 1e4, "new": 1e-3} in resume["changes"]


class NaNOnChosenSteps(GPTTrainer):
    """GPT whose loss is NaN on the examples of chosen steps (found by their tokens, so it does
    not depend on the layout); its gradients stay finite, so only the loss is non-finite."""

    bad_steps = (2, 4, 5)

    def __init__(self, config, policy, topology=None):
        super().__init__(config, policy, topology)
        plan = self.batch_plan
        sampler = Sampler(load_corpus(None).train, plan.seq_len, config.training.seed)
        self.bad_examples = np.concatenate(
            [
                sampler.global_batch((step - 1) * plan.global_batch_size, 1, 16)[0]
                for step in self.bad_steps
            ]
        )  # (bad steps × examples, seq_len + 1)

    def loss(self, model, tokens, keys, *, train):  # tokens: (examples, seq_len + 1)
        loss = super().loss(model, tokens, keys, train=train)
        same = jnp.all(tokens[:, None, :] == self.bad_examples[None], axis=-1)
        return jnp.where(jnp.any(same), jnp.nan, loss)


def test_skip_keeps_the_state_marks_the_step_and_stops_after_a_streak(tmp_path):
    settings = ("training.nonfinite=skip", "training.max_skipped_steps=2", "training.steps=8")
    trainer = NaNOnChosenSteps(
        config(*settings, "checkpointing.interval=1", "checkpointing.keep=8"),
        ShardingPolicy(tp=2, fsdp=True),
    )
    with pytest.raises(NonFiniteError, match="step 5: loss is nan") as stop:
        train(trainer, tmp_path)
    assert "training.max_skipped_steps=2 steps in a row" in str(stop.value)
    rows = strict_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in rows] == [False, True, False, True, True]
    assert rows[1]["loss"] is None and np.isfinite(rows[1]["grad_norm"])
    with Checkpointer(tmp_path / "checkpoints", read_only=True) as checkpointer:
        assert checkpointer.all_steps() == [1, 2, 3, 4]  # nothing saved at the stopping step
        states = {
            s: checkpointer.restore_state(s, restore_target(trainer)).state for s in (1, 2, 3, 4)
        }
    for before, after in ((1, 2), (3, 4)):
        same = (states[before].params, states[before].opt_state)
        now = (states[after].params, states[after].opt_state)
        for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(now), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(states[after].step) == after  # the step counter goes on
    changed = jax.tree.leaves(states[3].params)[0] != jax.tree.leaves(states[2].params)[0]
    assert bool(jnp.any(changed))  # the good step after a skip trains


def test_the_nonfinite_guard_keeps_no_second_copy_of_the_state(monkeypatch):
    """Compile only: the DP step that can drop its update needs no more temporaries than one
    that always updates. (A select between old and new state made XLA copy the optimizer state:
    1.26x the temporaries here, where the state is large next to the activations.)"""
    state_heavy = config(
        "model.n_embd=96",
        "model.block_size=8",
        "training.batch_size=8",
        "training.per_device_batch_size=1",
    )
    guarded = GPTTrainer(state_heavy, ShardingPolicy(zero=False)).compile()

    def always(update, params, opt_state, metrics):
        return (*update(params, opt_state), {**metrics, "skipped": jnp.zeros((), bool)})

    monkeypatch.setattr("theseus.training.step.update_if_finite", always)
    unguarded = GPTTrainer(state_heavy, ShardingPolicy(zero=False)).compile()
    assert guarded.temporaries <= unguarded.temporaries * 1.01
    assert guarded.peak <= unguarded.peak * 1.01


# --- resuming with changed settings ------------------------------------------------------------


def test_resume_changes_that_keep_the_numbers_are_accepted_and_others_refused():
    saved = GPTTrainerConfig().model_dump(mode="json")
    facts = {"policy": {"tp": 1}, "mesh_shape": {"batch": 8}, "num_devices": 8, "num_processes": 1}
    batch = {"replicas": 8, "per_device_batch_size": 4, "accumulation_steps": 1}
    batch |= {"global_batch_size": 32, "seq_len": 64}
    meta = CheckpointMeta(step=10, data_position=320, config=saved, **facts, **batch)
    kept = apply_overrides(
        GPTTrainerConfig(),
        ["training.steps=500", "logging.log_interval=3", "checkpointing.interval=7"],
    )
    new_facts = {**facts, "policy": {"tp": 2}, "mesh_shape": {"batch": 2}, "num_devices": 4}
    changes = resume_changes(meta, kept, new_facts)
    assert {c.key for c in changes} == {
        "training.steps",
        "logging.log_interval",
        "checkpointing.interval",
        "policy",
        "mesh_shape",
        "num_devices",
    }
    check_resume(changes, "run", allow_changes=False)  # all accepted
    for override, old, new in [
        ("optimization.learning_rate=0.001", "0.003", "0.001"),
        ("training.seed=7", "0", "7"),
        ("training.batch_size=64", "32", "64"),
        ("model.n_layer=3", "4", "3"),
        ("data.validation_fraction=0.2", "0.1", "0.2"),
        ("optimization.warmup_steps=5", "20", "5"),
    ]:
        changed = apply_overrides(GPTTrainerConfig(), [override])
        changes = resume_changes(meta, changed, facts)
        key = override.split("=")[0]
        with pytest.raises(ValueError, match=f"{key}: {old} -> {new}.*--allow-changes"):
            check_resume(changes, "run", allow_changes=False)
        check_resume(changes, "run", allow_changes=True)
    # A checkpoint of an older theseus lacks the settings added since: they are not changes.
    older = {key: value for key, value in saved.items() if key != "finetune"}
    older["model"] = {key: value for key, value in saved["model"].items() if key != "dropout"}
    meta = CheckpointMeta(step=10, data_position=320, config=older, **facts, **batch)
    assert resume_changes(meta, GPTTrainerConfig(), facts) == []


# --- saves that fail ---------------------------------------------------------------------------


def make_unwritable(directory):
    """Stop writes into ``directory`` for whoever runs the tests: ``chattr +i`` for root (whom
    permissions do not stop), ``chmod`` for others. Returns the undo, or None if it did not work."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            return None
        subprocess.run(["chattr", "+i", str(directory)], check=False, capture_output=True)

        def undo():
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o555)

        def undo():
            directory.chmod(0o755)

    try:
        (directory / "probe").mkdir()
    except OSError:
        return undo
    (directory / "probe").rmdir()
    undo()
    return None


def six_step_trainer():
    """Six steps on one device, saved every 2 synchronously, scored every 3 (when an evaluator
    is given): one trainer, one compiled step for the failed save and the failing evaluation."""
    settings = ("training.steps=6", "checkpointing.async_save=false", "logging.log_interval=1")
    return shared_trainer(config(*settings, "evaluation.interval=3"), ShardingPolicy())


def test_failed_save_stops_the_run_and_keeps_committed_checkpoints(tmp_path):
    trainer = six_step_trainer()
    undo = []

    def log(line):  # after step 2 is saved and step 4 is not: the directory turns read-only
        if line.startswith("step 3/") and not undo:
            restore_writes = make_unwritable(tmp_path / "checkpoints")
            if restore_writes is None:
                pytest.skip("cannot make a directory unwritable here (no chattr for root)")
            undo.append(restore_writes)

    try:
        with pytest.raises(CheckpointWriteError) as failed, log_lines(log):
            train(trainer, tmp_path)
    finally:
        for restore_writes in undo:
            restore_writes()
    message = str(failed.value)
    assert f"cannot save checkpoint step 4 in {tmp_path / 'checkpoints'}" in message
    assert "Operation not permitted" in message or "Permission denied" in message
    assert failed.value.exit_code == 5
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        assert checkpointer.all_steps() == [2]
        restored = checkpointer.restore_state(None, restore_target(trainer))
    assert restored.step == 2 and checkpointer.skipped == ()
    assert isinstance(restored.state, TrainState)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_a_failing_evaluation_is_reported_and_training_goes_on(tmp_path):
    """evaluation.tasks's scorer raising at a step: the run says which step and why, records the
    step without scores and trains and saves to the end. (The harness's own refusal, a task's
    unsupported generation setting, is test_harness.py's.)"""
    trainer = six_step_trainer()
    asked = []

    def failing(params, step):
        asked.append(step)
        raise ValueError("generation settings num_beams are not supported")

    logged = []
    with log_lines(logged.append):
        train(trainer, tmp_path, evaluator=failing)
    assert asked == [3, 6]
    for step in asked:
        reported = f"scoring evaluation.tasks at step {step} failed (ValueError: generation"
        assert any(reported in line for line in logged), logged
    rows = strict_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert not any("tasks" in r for r in rows)
    with Checkpointer(tmp_path / "checkpoints", read_only=True) as checkpointer:
        assert checkpointer.all_steps()[-1] == 6


# --- preemption ----------------------------------------------------------------------------------


def test_one_process_preemption_flag_and_second_sigterm_default():
    """One process: SIGTERM sets the flag; a second SIGTERM is left to the default action (ends
    the process at once, like SIGKILL, whose resume test_cli covers); the handler is removed after
    the run."""
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch(lambda step: pytest.fail("no sync point with one process")) as watch:
        assert not watch.reached()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while not watch.reached() and time.time() < deadline:
            time.sleep(0.01)
        assert watch.reached()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == before


# --- dashboards ----------------------------------------------------------------------------------


class FlakyDashboard:
    """A dashboard that refuses rows while ``down`` and fails to close when ``broken``."""

    def __init__(self):
        self.down, self.broken, self.steps = False, False, []

    def write(self, row):
        if self.down:
            raise OSError(28, "No space left on device")
        self.steps.append(row["step"])

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.broken:
            raise OSError(28, "No space left on device")


def test_a_failing_dashboard_holds_rows_up_to_a_bound_and_never_raises(monkeypatch):
    """Held rows beyond MAX_HELD_ROWS are given up, oldest first, and said when the dashboard
    is back; rows still held at the end and a failing close are one line each, and ``missed``
    gets the first step the dashboard never received."""
    monkeypatch.setattr(dashboards, "MAX_HELD_ROWS", 2)
    board, lines, missed = FlakyDashboard(), [], []
    with log_lines(lines.append), GuardedDashboard(board, "TB", missed=missed.append) as guard:
        guard.write({"step": 1})
        board.down = True
        for step in range(2, 7):
            guard.write({"step": step})
        board.down = False
        guard.write({"step": 7})  # back: steps 2-4 were given up, 5-7 caught up
        board.down = board.broken = True
        guard.write({"step": 8})
    assert board.steps == [1, 5, 6, 7]
    assert lines == [
        "TB failed at step 2 (OSError: [Errno 28] No space left on device); training goes on "
        "and every row is in metrics.jsonl; TB gets the rows it missed if it works again "
        "during the run",
        "TB works again at step 7; it could not catch up on steps 2-4 (more than 2 rows were "
        "missed): they are in metrics.jsonl only",
        "TB failed at step 8 (OSError: [Errno 28] No space left on device); training goes on "
        "and every row is in metrics.jsonl; TB gets the rows it missed if it works again "
        "during the run",
        "TB could not be closed (OSError: [Errno 28] No space left on device)",
        "TB did not get step 8 (metrics.jsonl holds every row)",
    ]
    assert missed == [8]
