"""What several test files share: tiny GPT configurations, the 7.5B configuration of the scale
tests and benches, tiny corpora, the CLI, the environment of subprocesses, and the equivalence
harness (policies, batches, "run N steps", "assert the same numbers")."""

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from typer.testing import CliRunner, Result

from theseus.cli.app import app
from theseus.config import apply_overrides
from theseus.data import Sampler, load_corpus, validation_batches
from theseus.data.packing import MASK, SEGMENTS, document_rows
from theseus.jobs import families
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology, UnderMesh
from theseus.training.trainer import BaseTrainer, TrainerConfig

# The model families from the registry (tests, like the package, never import a family module).
FAMILIES = families()
GPT_FAMILY, LLAMA_FAMILY = FAMILIES["gpt"].family, FAMILIES["llama"].family
GPT, GPTConfig, GPT_PLAN = GPT_FAMILY.model_class, GPT_FAMILY.config_class, GPT_FAMILY.plan
Llama, LlamaConfig = LLAMA_FAMILY.model_class, LLAMA_FAMILY.config_class
GPTTrainer, LlamaTrainer = FAMILIES["gpt"].trainer_class, FAMILIES["llama"].trainer_class
GPTTrainerConfig, LlamaTrainerConfig = GPTTrainer.config_class, LlamaTrainer.config_class

# n_embd and n_mlp divide by 8 (tp=8 and FSDP over 8 devices); other dims differ from them.
# Dropout is on: per-example keys must make its masks the same under every layout.
EQUIVALENCE_MODEL = GPTConfig(
    vocab_size=256, block_size=24, n_layer=3, n_head=4, n_embd=40, mlp_ratio=4, dropout=0.1
)
EQUIVALENCE_BATCH = 32

# A GPT small enough to compile in seconds; 16 examples split over any of the 8 devices; with
# dropout, so that resumed and multi-process runs also show per-example keys at work.
TINY_GPT = (
    "model.n_layer=2",
    "model.dropout=0.1",
    "model.n_embd=32",
    "model.n_head=4",
    "model.block_size=16",
    "training.batch_size=16",
    "training.per_device_batch_size=2",
    "training.validation_interval=2",
    "training.validation_batches=1",
    "checkpointing.interval=2",
    "logging.progress_bar=false",
)


# About 7.5B parameters (Ψ = 7,464,640,512): the GPT of the planner's and FSDP's scale figures.
# The vocabulary is padded to 50432 = 197 × 256, so ZeRO divides it over up to 256 devices.
GPT_7_5B = (
    "model.vocab_size=50432",
    "model.block_size=2048",
    "model.n_layer=36",
    "model.n_head=32",
    "model.n_embd=4096",
)

# A few lines of text that tiny corpora repeat (bytes are tokens unless a tokenizer is trained).
TEXT = "Beautiful is better than ugly.\nExplicit is better than implicit.\nSimple beats complex.\n"


def write_corpus(folder: Path, num_files: int = 3) -> Path:
    """A folder of ``num_files`` small text files of different lengths; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(num_files):
        (folder / f"part{index}.txt").write_text(TEXT * (40 + 7 * index) + f"file {index}\n")
    return folder


def read_events(directory: Path) -> dict[str, dict[int, object]]:
    """Every summary value of the TensorBoard event files under ``directory``: tag -> step ->
    value (TFRecord framing: length, its CRC, the Event proto, its CRC)."""
    from tensorboardX.proto import event_pb2  # the test extra has it; the package does not need it

    values: dict[str, dict[int, object]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                got = value.simple_value if kind == "simple_value" else value.tensor
                values.setdefault(value.tag, {})[event.step] = got
    return values


def write_mixture(root: Path, weights: tuple[float, float] = (0.7, 0.3)) -> str:
    """Two byte sources of different text under ``root``, JSON Lines documents and a plain text
    file; returns their ``data.sources`` value with ``weights``."""
    root.mkdir(parents=True, exist_ok=True)
    records = [
        {"text": f"record {i}: " + "lorem ipsum dolor sit amet " * (3 + i % 5)} for i in range(211)
    ]
    (root / "notes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "fox.txt").write_text("The quick brown fox jumps over the lazy dog. " * 301)
    return f"{root / 'notes.jsonl'}:{weights[0]},{root / 'fox.txt'}:{weights[1]}"


def invoke(*args: object) -> Result:
    """Run the ``theseus`` command in this process (``result.exit_code``, ``result.output``)."""
    return CliRunner().invoke(app, [str(a) for a in args])


# Every process of a multi-process subprocess writes the compilation cache (its sitecustomize.py).
SUBPROCESS_SITE = Path(__file__).with_name("subprocess_site")


def subprocess_env() -> dict[str, str]:
    """This environment (the session's compilation cache and XLA flags among it) without the
    forced 8 devices: a subprocess picks its own count with --cpu-devices or
    jax_num_cpu_devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SUBPROCESS_SITE), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


# --- the equivalence harness ---------------------------------------------------------------------
#
# "Train a few steps under a policy, compare with one device": every equivalence test uses these.
# Trainers are memoised per worker, so identical configurations share one trace and one compiled
# step; the runs of references are memoised too. Tolerances are CONTRIBUTING's and never change.

LOSS_RTOL = 1e-5  # losses (and validation losses) against one device, relative
PARAM_ATOL = 1e-4  # parameters after a few AdamW steps (about the learning rate)
STEPS = 3
# XLA:CPU's default code generation, for claims that depend on it (tests/conftest.py); None where
# the tests already compile with it (a jaxlib without the classic emitters' flag).
CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
DEFAULT_CODEGEN = {"xla_cpu_use_fusion_emitters": True} if CLASSIC_EMITTERS else None

POLICIES = [
    ShardingPolicy(tp=1, zero=False),
    ShardingPolicy(tp=1),
    ShardingPolicy(tp=1, fsdp=True),
    ShardingPolicy(tp=2),
    ShardingPolicy(tp=2, fsdp=True),
    ShardingPolicy(tp=8, zero=False),
]  # tp=4 + FSDP: the families' matrix (FAMILY_POLICIES), the same trainer code with GQA

# A family's matrix: the policies whose step runs the family's own sharded code in a way no other
# policy does. The families' test models have 8 query and 2 key/value heads: tp=2 splits both,
# tp=4 splits the queries and holds each key/value head on two devices, both under FSDP (weights
# stored in shards, gathered a layer at a time in the layer scan). DP splits only the batch;
# ZeRO computes in DP's layout and updates in FSDP's partition; tp=2 or 8 without FSDP computes
# in a layout of these two with the weights already whole; tp=1 + FSDP computes in the one-device
# run's layout. Their steps hold no family program these two lack, and GPT's full matrix
# (tests/test_trainer.py) proves each of them.
FAMILY_POLICIES = [
    ShardingPolicy(tp=2, fsdp=True),
    ShardingPolicy(tp=4, fsdp=True),
]


def policy_id(policy: ShardingPolicy) -> str:
    remat = (
        "" if policy.activation_checkpointing == "none" else f"-{policy.activation_checkpointing}"
    )
    return f"tp{policy.tp}-zero{policy.zero}-fsdp{policy.fsdp}{remat}"


# Every Llama feature on: GQA (8 query heads, 2 key/value heads), a head_dim (8) apart from
# hidden_size / num_heads (5), q/k/v biases, q/k norms, Llama 3.1 rotary scaling, untied head.
# The q, k/v and MLP widths (64, 16, 48) and the vocabulary divide by 8 (tp=8, ZeRO over 8).
EQUIVALENCE_LLAMA = LlamaConfig(
    vocab_size=256,
    hidden_size=40,
    intermediate_size=48,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=24,
    rope_type="llama3",
    rope_original_max_position_embeddings=8,
    attention_bias=True,
    qk_norm=True,
)

TRAINERS: dict[type, type[BaseTrainer]] = {
    f.family.config_class: f.trainer_class for f in FAMILIES.values()
}


def equivalence_config(
    per_device_batch_size: int,
    model: GPTConfig | LlamaConfig = EQUIVALENCE_MODEL,
    *overrides: str,
    **training,
) -> TrainerConfig:
    """A global batch of 32 and a learning rate of 1e-3, small enough that parameters of
    different layouts agree to 1e-4 after a few Adam steps; the trainer config of ``model``'s
    family, ``training.KEY=VALUE`` from ``training`` and then ``overrides``."""
    settings = {
        "training.batch_size": EQUIVALENCE_BATCH,
        "training.per_device_batch_size": per_device_batch_size,
        "training.steps": 100,
        "optimization.learning_rate": 1e-3,
        "optimization.warmup_steps": 1,
        **{f"training.{k}": v for k, v in training.items()},
    }
    config_class = TRAINERS[type(model)].config_class
    assignments = [f"{k}={v}" for k, v in settings.items()]
    return apply_overrides(config_class(model=model), [*assignments, *overrides])


def policy_config(
    policy: ShardingPolicy, accumulation: int, model=EQUIVALENCE_MODEL, *overrides: str
) -> TrainerConfig:
    """The equivalence config whose 32 examples take ``accumulation`` microbatches under
    ``policy`` on 8 devices."""
    replicas = 8 // policy.tp
    return equivalence_config(EQUIVALENCE_BATCH // (replicas * accumulation), model, *overrides)


_TRAINERS: dict[tuple, BaseTrainer] = {}


def shared_trainer(
    config: TrainerConfig,
    policy: ShardingPolicy,
    *,
    num_devices: int = 8,
    trainer_class: type[BaseTrainer] | None = None,
) -> BaseTrainer:
    """The trainer of ``config`` under ``policy`` on the first ``num_devices`` devices, built
    once per worker: tests that ask for the same one share its traced and compiled steps. (Use it
    for trainers whose steps a test only calls; build your own to change one.)"""
    trainer_class = trainer_class or TRAINERS[type(config.model)]
    key = (trainer_class, config.model_dump_json(), policy, num_devices)
    if key not in _TRAINERS:
        topology = Topology.new(policy, devices=jax.devices()[:num_devices])
        _TRAINERS[key] = trainer_class(config, policy, topology)
    return _TRAINERS[key]


@functools.cache
def builtin_corpus():
    return load_corpus(None)


def step_batch(trainer: BaseTrainer, index: int) -> jax.Array:
    """Global batch ``index`` of the built-in corpus: the same examples under every mesh and
    accumulation split."""
    plan = trainer.batch_plan
    rows = Sampler(builtin_corpus().train, plan.seq_len, seed=0).global_batch(
        index * plan.global_batch_size, plan.accumulation_steps, plan.examples_per_microbatch
    )  # (accumulation, examples, seq_len + 1)
    return trainer.put_batch(lambda r: rows[:, r], rows.shape)


def uneven_batch(
    trainer: BaseTrainer, index: int, cuts: Callable[[int, int, int], np.ndarray]
) -> jax.Array:
    """Step ``index``'s built-in windows as segmented rows whose trained tokens differ wildly
    between examples (hence between microbatches and replicas): example ``j`` of the global
    batch starts a new segment at each token index of ``cuts(index, j, width)`` (sorted, in
    ``(0, width)``), pads its last ``j % 4 * 3`` tokens, and trains none, a few or most of its
    targets as ``j % 5`` says."""
    plan = trainer.batch_plan
    windows = Sampler(builtin_corpus().train, plan.seq_len, seed=0).global_batch(
        index * plan.global_batch_size, plan.accumulation_steps, plan.examples_per_microbatch
    )  # (accumulation, examples, seq_len + 1)
    flat = windows.reshape(-1, windows.shape[-1])  # (global batch, seq_len + 1)
    rows = document_rows(flat, eos_id=None)  # (global batch, 3, seq_len + 1)
    width = flat.shape[1]
    for j in range(flat.shape[0]):
        boundaries = cuts(index, j, width)  # (segments - 1,)
        rows[j, SEGMENTS] = 1 + np.searchsorted(boundaries, np.arange(width), side="right")
        density = (0.0, 0.05, 0.3, 0.9, 1.0)[j % 5]
        rows[j, MASK] = np.random.default_rng([index, j]).random(width) < density
        pad = j % 4 * 3
        if pad:
            rows[j, :, width - pad :] = 0
    rows = rows.reshape(*windows.shape[:2], *rows.shape[1:])
    return trainer.put_batch(lambda r: rows[:, r], rows.shape)


def validation_batch(trainer: BaseTrainer, num_batches: int) -> jax.Array:
    plan = trainer.batch_plan
    held_out = validation_batches(
        builtin_corpus().validation,
        plan.seq_len,
        num_batches * plan.accumulation_steps,
        plan.examples_per_microbatch,
    )
    return trainer.put_batch(lambda r: held_out[:, r], held_out.shape)


@dataclasses.dataclass(frozen=True)
class Run:
    """What a few steps gave: per-step losses, the initial and final parameters (host),
    the validation loss (None without validation) and the step counter."""

    losses: np.ndarray
    initial: Any
    params: Any
    val_loss: float | None
    step: int


_RUNS: dict[tuple, Run] = {}  # keyed by the trainer itself, which the memo keeps alive


def run_steps(
    trainer: BaseTrainer,
    steps: int = STEPS,
    *,
    validation: int = 0,
    compiler_options: dict[str, Any] | None = None,
    batches: Callable[[BaseTrainer, int], jax.Array] = step_batch,
) -> Run:
    """``steps`` steps from the trainer's initial state on ``batches(trainer, index)`` (default:
    the built-in corpus's; and the mean validation loss of ``validation`` batches after them),
    the step compiled with XLA's ``compiler_options`` when given; memoised per trainer."""
    options = tuple(sorted((compiler_options or {}).items()))
    key = (trainer, steps, validation, options, batches)
    if key in _RUNS:
        return _RUNS[key]
    step = trainer.train_step
    if compiler_options is not None:
        shape = jax.ShapeDtypeStruct(
            trainer.batch_plan.shape, np.int32, sharding=trainer.batch_sharding
        )
        lowered = trainer.train_step.lower(trainer.abstract_state, shape)
        compiled = lowered.compile(compiler_options=compiler_options)
        step = UnderMesh(compiled, trainer.topology.device_mesh)
    state = trainer.init_state()
    initial = jax.device_get(state.params)
    losses = []
    for index in range(steps):
        state, metrics = step(state, batches(trainer, index))
        losses.append(float(metrics["loss"]))
    val_loss = None
    if validation:
        val_loss = float(
            trainer.validation_step(state.params, validation_batch(trainer, validation))["loss"]
        )
    run = Run(np.array(losses), initial, jax.device_get(state.params), val_loss, int(state.step))
    _RUNS[key] = run
    return run


def one_device_run(
    config: TrainerConfig,
    steps: int = STEPS,
    *,
    validation: int = 0,
    batches: Callable[[BaseTrainer, int], jax.Array] = step_batch,
) -> Run:
    """The reference: ``config``'s whole global batch on one device, no accumulation."""
    single = config.model_copy(deep=True)
    single.training.per_device_batch_size = single.training.batch_size
    trainer = shared_trainer(single, ShardingPolicy(), num_devices=1)
    assert trainer.batch_plan.accumulation_steps == 1
    return run_steps(trainer, steps, validation=validation, batches=batches)


def assert_same_numbers(
    got: Run, want: Run, *, loss_rtol: float = LOSS_RTOL, param_atol: float = PARAM_ATOL
) -> None:
    """Losses (and validation losses) within ``loss_rtol`` relative, parameters within
    ``param_atol``, the same step counter, and a falling loss (so the run trained)."""
    np.testing.assert_allclose(got.losses, want.losses, rtol=loss_rtol)
    assert got.losses[-1] < got.losses[0], got.losses
    assert got.step == want.step
    flat = jax.tree_util.tree_flatten_with_path(got.params)[0]
    for (path, value), expected in zip(flat, jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(value, expected, atol=param_atol, rtol=0, err_msg=str(path))
    assert (got.val_loss is None) == (want.val_loss is None)
    if want.val_loss is not None:
        np.testing.assert_allclose(got.val_loss, want.val_loss, rtol=loss_rtol)


def plan_on_64_devices(folder: Path, hf_config: dict, seq_len: int) -> dict:
    """``theseus plan --hf`` of ``hf_config`` (written to ``folder``) on 64 devices, tp=8 with
    FSDP, a batch of 64 rows of ``seq_len`` in bfloat16: the JSON plan, checked to have the
    8 × 8 mesh and no problems."""
    (folder / "config.json").write_text(json.dumps(hf_config))
    training = [
        f"training.seq_len={seq_len}", "training.batch_size=64", "training.dtype=bfloat16",
        "training.per_device_batch_size=1",
    ]  # fmt: skip
    flags = ("--devices", "64", "--tp", "8", "--fsdp", "--json")
    result = invoke("plan", "--hf", folder, *flags, *training)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["mesh"] == {"batch": 8, "shard": 8}
    assert all(not row["problems"] for row in plan["rows"])
    return plan


class _Lines(logging.Handler):
    def __init__(self, on_line: Callable[[str], None]):
        super().__init__(logging.INFO)
        self.on_line = on_line

    def emit(self, record: logging.LogRecord) -> None:
        self.on_line(record.getMessage())


@contextlib.contextmanager
def log_lines(on_line: Callable[[str], None]) -> Iterator[None]:
    """Call ``on_line(text)`` for each line (info and above) theseus logs inside the block: the
    lines ``theseus train`` prints."""
    logger, handler = logging.getLogger("theseus"), _Lines(on_line)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# Llama 3.1 8B's config.json as transformers 4.x writes it (the layout of the published files).
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def assert_gathers_agree(got: Run, want: Run):
    """Losses and parameters of two runs agree to 1e-6. The two runs are different programs
    (a gather of bfloat16 or of float32 values), so the claim holds as far as XLA rounds them
    alike: XLA:CPU's default emitters do, bit for bit; the classic ones the tests otherwise
    compile with (tests/conftest.py) do not, so these runs compile with the default."""
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-6)
    assert got.losses[-1] < got.losses[0]
    flat = jax.tree_util.tree_flatten_with_path(got.params)[0]
    for (path, value), expected in zip(flat, jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(value, expected, atol=1e-6, rtol=0, err_msg=str(path))


@functools.cache
def default_codegen_hlo(trainer: BaseTrainer) -> str:
    """The trainer's step compiled with XLA's default code generation, as text (memoised);
    ``run_steps(trainer, compiler_options=DEFAULT_CODEGEN)`` then reads the compiled program from
    the compilation cache."""
    batch = jax.ShapeDtypeStruct(
        trainer.batch_plan.shape, np.int32, sharding=trainer.batch_sharding
    )
    lowered = trainer.train_step.lower(trainer.abstract_state, batch)
    return lowered.compile(compiler_options=DEFAULT_CODEGEN).as_text()


def assert_compute_dtype_gathers(model, casts: set[str]) -> None:
    """Under FSDP and bfloat16 (``training.gather_dtype=compute``), ``model``'s matrices travel
    through the layer loop's all-gathers as 16-bit patterns, forward and in the recomputed
    backward, and its parameters gathered before the loss that are cast are ``casts``; gradients
    are reduced in float32. The step compiles with the suite's flags: this reads the family's
    gathers, not its numbers. That narrowed gathers train to the numbers of float32 ones is
    proven on GPT under tp=2 + FSDP and on a model without a layer scan
    (tests/test_gather_dtype.py); a family reaches the same code (the layer scan's
    ``move_to_compute`` and the entry's cast analysis), so what a family decides is which leaves
    travel narrow, which this checks."""
    config = equivalence_config(1, model, dtype="bfloat16", gather_dtype="compute")
    trainer = shared_trainer(config, ShardingPolicy(fsdp=True))
    assert trainer.entry.casts == casts, sorted(trainer.entry.casts)
    layers = model.num_layers
    assert layers != trainer.batch_plan.accumulation_steps  # the layer loop's trip count
    hlo = trainer.compile().executable.as_text()
    per_layer = {leaf.path: leaf for leaf in trainer.abstract_leaves}
    num_matrices = sum(len(per_layer[p].shape) == 3 for p in trainer.per_layer_paths)
    matrices = layer_loop_matrix_gathers(hlo, layers)
    assert len(matrices) == 2 * num_matrices and num_matrices >= 7, matrices
    assert all(t.startswith("u16[") for t in matrices), matrices
    assert_reductions_in_float32(hlo)


def layer_loop_matrix_gathers(hlo: str, layers: int) -> list[str]:
    """The result types of the all-gathers of matrices (rank 2 or more) in the loops of
    ``layers`` trips of the compiled ``hlo``: the layer loop's weight gathers."""
    from theseus.accounting.collectives import loop_collective_types

    gathers = loop_collective_types(hlo, "all-gather")
    return [t for trip, t in gathers if trip == layers and "," in t.split("{")[0]]


def assert_reductions_in_float32(hlo: str) -> None:
    """The compiled ``hlo`` reduces (its gradients) and reduces nothing in 16 bits."""
    reductions = [line for line in hlo.splitlines() if " all-reduce(" in line]
    assert reductions and not [line for line in reductions if "bf16" in line or "u16" in line]


def assert_flops_match_xla(model) -> None:
    """The family's FLOPs per token formula for ``model`` is within 10% of XLA's count of the
    one-device train step."""
    from theseus.training.flops import xla_flops_per_token

    one = shared_trainer(equivalence_config(4, model), ShardingPolicy(), num_devices=1)
    analytic, xla = one.flops_per_token(), xla_flops_per_token(one)
    assert abs(analytic / xla - 1) < 0.1, (analytic, xla)


def optional_module(name: str, extra: str, what: str):
    """The module ``name``, or a skip (a failure under CI) without the extra ``extra``."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"needs {what}: pip install -c constraints.txt -e '.[{extra}]'")


def lm_eval_module():
    """lm_eval, or a skip (a failure under CI) without the ``eval`` extra."""
    return optional_module("lm_eval", "eval", "lm-evaluation-harness")


def trl_module():
    """trl, or a skip (a failure under CI) without the ``hf-reference`` extra."""
    return optional_module("trl", "hf-reference", "TRL")


@contextlib.contextmanager
def interrupted_records(module, after: int) -> Iterator[None]:
    """``module.raw_records`` (a chat tokenizing module's reader) raising KeyboardInterrupt at
    record ``after``, as an interrupted run meets it; the reader restored when the block ends."""
    original = module.raw_records

    def interrupted(files):
        for number, record in enumerate(original(files)):
            if number == after:
                raise KeyboardInterrupt
            yield record

    module.raw_records = interrupted
    try:
        yield
    finally:
        module.raw_records = original
