"""The plan of one policy on any number of devices, with every other policy side by side.

The planner is a pure function of a trainer class, its config, a :class:`ShardingPolicy` and a
device count. It builds one trainer on a one-device ``AbstractMesh`` (its state is
``jax.eval_shape`` only, nothing allocated) and, for every policy, resolves the layouts on an
``AbstractMesh`` of the target shape and runs the trainer constructor's own pre-flight check
(:func:`theseus.accounting.preflight.preflight`), so a model of billions of parameters plans for
hundreds of devices in seconds on a laptop.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax

from theseus.accounting.activations import FLOAT32, ActivationMemory, Device, activation_memory
from theseus.accounting.memory import CompiledStep, MemoryTotals, format_bytes, tree_bytes
from theseus.accounting.preflight import BatchPlan, preflight
from theseus.config import apply_overrides
from theseus.plan.policies import candidate_policies, communication_key
from theseus.plan.results import ClosedForm, Plan, PolicyOption, RematOption, Verdict
from theseus.plan.rollout import CompiledRollout, compile_rollout, rollout_memory
from theseus.posttraining.rl.trainer import RLTrainer
from theseus.sharding.axis import MESH_AXES, REMAT_POLICIES, Axis, ShardingPolicy, partition_spec
from theseus.sharding.layout import LayoutError, shard_shape
from theseus.sharding.topology import Topology, mesh_grid_shape, resolve_devices_per_host
from theseus.training.summary import plan_rows, replicated_share
from theseus.training.trainer import BaseTrainer, TrainerConfig


def plan(
    trainer_class: type[BaseTrainer],
    config: TrainerConfig,
    policy: ShardingPolicy,
    num_devices: int,
    *,
    devices_per_host: int | None = None,
    compile: bool = False,
    alternatives: bool = True,
    compare_remat: bool = True,
    device_memory: int | None = None,
) -> Plan:
    """The plan of ``policy`` on ``num_devices`` devices, with every other policy side by side
    (``alternatives=False``: this policy alone, which is faster).

    Memory per device is the model state plus one microbatch's activations
    (:mod:`theseus.accounting.activations`); an RL job's is the larger of that step and its
    rollout (:mod:`theseus.plan.rollout`); with ``device_memory`` (bytes per device) the
    verdict fails when it does not fit.

    Works from abstract shapes only; nothing the size of the model is allocated. ``compile=True``
    also compiles the real train step (an RL job's: on completion rows, and its generation
    programs) on the first ``num_devices`` devices of this process and
    adds its ``memory_analysis()`` (only when the verdict is ok) and, with ``compare_remat``,
    compiles the same policy under every recompute policy to compare their peaks and FLOPs
    (:data:`~theseus.sharding.axis.REMAT_POLICIES`). Raises ``ValueError`` for bad
    input (an invalid config, a device count that cannot be meshed); a policy that fails the
    pre-flight check is not an error here but the plan's ``verdict``.
    """
    if not isinstance(config, trainer_class.config_class):
        raise TypeError(
            f"{trainer_class.__name__} plans a {trainer_class.config_class.__name__}, got "
            f"{type(config).__name__}"
        )
    per_host = resolve_devices_per_host(num_devices, devices_per_host)
    if num_devices % policy.tp:
        raise ValueError(
            f"tp={policy.tp} does not divide {num_devices} devices; the mesh is "
            f"(devices / tp, tp). Choose a tp that divides {num_devices}."
        )
    shapes = _shape_trainer(trainer_class, config, policy)
    candidates = [policy]
    if alternatives:
        candidates = candidate_policies(
            num_devices,
            per_host,
            activation_checkpointing=policy.activation_checkpointing,
            experts=policy.experts,
        )
        candidates = sorted({*candidates, policy}, key=communication_key)
    options, batch_plan = [], None
    for rank, candidate in enumerate(candidates):
        option, candidate_batch = _option(shapes, config, candidate, num_devices, per_host, rank)
        options.append(option)
        if candidate == policy:
            chosen, batch_plan = option, candidate_batch
    compiled: CompiledStep | None = None
    compiled_rollout: CompiledRollout | None = None
    remat: tuple[RematOption, ...] = ()
    verdict = chosen.verdict
    if verdict.ok and device_memory is not None:
        verdict = memory_verdict(chosen, device_memory)
    if verdict.ok:
        verdict = dataclasses.replace(
            verdict, gathering=gathering(shapes, policy, chosen.mesh_shape)
        )
        if compile:
            device = _device_trainer(trainer_class, config, policy, num_devices)
            compiled = device.compile()
            if isinstance(device, RLTrainer):
                compiled_rollout = compile_rollout(device)
        if compiled is not None and compare_remat:
            remat = remat_options(trainer_class, config, policy, num_devices, compiled)
    return Plan(
        trainer=trainer_class.__name__,
        num_params=shapes.num_params,
        num_devices=num_devices,
        devices_per_host=per_host,
        mesh_shape=chosen.mesh_shape,
        policy=policy,
        batch=None if batch_plan is None else batch_plan.describe(),
        rows=plan_rows(shapes, policy, chosen.mesh_shape),
        totals=chosen.totals,
        verdict=verdict,
        replicated=replicated_share(shapes),
        closed_form=chosen.closed_form,
        options=tuple(options),
        compiled=compiled,
        remat=remat,
        activations=chosen.activations,
        device_memory=device_memory,
        rollout=chosen.rollout,
        compiled_rollout=compiled_rollout,
    )


def memory_verdict(option: PolicyOption, device_memory: int) -> Verdict:
    """Ok when ``option``'s model state and one microbatch's activations (an RL job's: and its
    rollout) fit in ``device_memory`` bytes per device, else the failure with what to change."""
    total = option.total
    if total is None or total <= device_memory:
        return option.verdict
    assert option.totals is not None  # a total has the model state in it
    state, acts, rollout = option.totals, option.activations, option.rollout
    parts = f"model state {format_bytes(state.total)}"
    if acts is not None:
        parts += (
            f" + activations {format_bytes(acts.total)} of one microbatch (recompute "
            f"{acts.remat}, {acts.kernel} attention)"
        )
    recompute = acts is None or acts.remat != "full"
    more = (
        "Recompute more (--activation-checkpointing dots or full), lower" if recompute else "Lower"
    )
    more += " training.per_device_batch_size"
    if rollout is not None:
        parts = (
            f"the larger of the training step, {parts} + completion rows "
            f"{format_bytes(rollout.batch)}, and the rollout, parameters and optimizer state "
            f"{format_bytes(state.persistent)} + generation {format_bytes(rollout.generation)}: "
            f"{rollout.describe()}"
        )
        more += (
            " (the step), lower training.batch_size × rl.steps_per_generation (the rollout's "
            "rows) or training.seq_len"
        )
    return Verdict(
        False,
        f"out of memory: {option.name} needs {format_bytes(total)} per device ({parts}) but a "
        f"device has {format_bytes(device_memory)}. {more}, shard more (--fsdp, --tp) or add "
        "devices; --budget chooses for you.",
    )


def remat_options(
    trainer_class: type[BaseTrainer],
    config: TrainerConfig,
    policy: ShardingPolicy,
    num_devices: int,
    compiled: CompiledStep,
) -> tuple[RematOption, ...]:
    """The compiled step of ``policy`` under each recompute policy (``compiled`` is the one of
    ``policy`` itself, reused)."""
    options = []
    for remat in REMAT_POLICIES:
        step = compiled
        if remat != policy.activation_checkpointing:
            changed = policy.merge(activation_checkpointing=remat)
            step = _device_trainer(trainer_class, config, changed, num_devices).compile()
        options.append(
            RematOption(
                remat=remat,
                peak=step.peak,
                temporaries=step.temporaries,
                dot_flops=step.dot_flops,
                all_gather=step.collectives["all-gather"].bytes,
            )
        )
    return tuple(options)


def _shape_trainer(
    trainer_class: type[BaseTrainer], config: TrainerConfig, policy: ShardingPolicy
) -> BaseTrainer:
    """The trainer on a one-device abstract mesh: the abstract state, whatever the mesh.

    Layout checks cannot fail on one device; the batch is reduced to one replica's share if it
    does not divide, since only shapes are read from this trainer. Config errors still raise.
    """
    probe = policy.merge(tp=1)
    training = config.training
    if training.batch_size % training.per_device_batch_size:
        config = apply_overrides(config, [f"training.batch_size={training.per_device_batch_size}"])
    return trainer_class(config, probe, Topology.abstract(probe, 1))


def _option(
    shapes: BaseTrainer,
    config: TrainerConfig,
    policy: ShardingPolicy,
    num_devices: int,
    devices_per_host: int,
    rank: int,
) -> tuple[PolicyOption, BatchPlan | None]:
    """One policy's mesh, totals and verdict: the trainer constructor's pre-flight check on the
    shape trainer's abstract state. When a non-layout error comes first, the layout check's error
    (if any) is kept as ``also``."""
    mesh_shape = dict(zip(MESH_AXES, mesh_grid_shape(policy, num_devices), strict=True))
    try:
        topology = Topology.abstract(policy, num_devices, devices_per_host)
    except ValueError as error:
        return PolicyOption(policy, mesh_shape, None, Verdict(False, str(error)), rank), None
    totals, layout_error, batch_plan, verdict = None, None, None, Verdict(True)
    try:
        totals = shapes.memory(policy, topology.mesh)
    except LayoutError as error:
        layout_error = str(error)
    try:
        batch_plan = preflight(
            shapes.abstract_params, shapes.plan, policy, topology, config.training, shapes.seq_len
        )
    except ValueError as error:
        verdict = Verdict(False, str(error))
        if layout_error is not None and layout_error != verdict.error:
            verdict = Verdict(False, verdict.error, layout_error)
    zero_model = closed_form(shapes, policy, mesh_shape[Axis.BATCH], totals)
    acts = activations(shapes, policy, batch_plan, totals, mesh_shape)
    rollout = None
    if isinstance(shapes, RLTrainer) and batch_plan is not None and totals is not None:
        rollout = rollout_memory(shapes, policy, batch_plan, mesh_shape)
    option = PolicyOption(policy, mesh_shape, totals, verdict, rank, zero_model, acts, rollout)
    return option, batch_plan


def activations(
    trainer: BaseTrainer,
    policy: ShardingPolicy,
    batch_plan: BatchPlan | None,
    totals: MemoryTotals | None,
    mesh_shape: dict[str, int],
) -> ActivationMemory | None:
    """One microbatch's activation memory per device under ``policy`` on a mesh of
    ``mesh_shape`` (None when the trainer's model is not a decoder the planner knows, or the
    batch or layouts do not work out)."""
    shape = trainer.decoder_shape()
    if shape is None or batch_plan is None or totals is None:
        return None
    dtype_bytes = np.dtype(trainer.compute_dtype).itemsize
    backend = jax.default_backend()
    device = Device.of(batch_plan, policy.tp, dtype_bytes, backend, trainer.loss_chunk)
    gathered = 0  # FSDP gathers each layer's weights, in the compute dtype when castable,
    if policy.fsdp and batch_plan.replicas > 1:  # and reduce-scatters its float32 gradient;
        cast = trainer.context.gather_dtype  # the tables are gathered whole where used
        itemsize = FLOAT32 if cast is None else np.dtype(cast).itemsize
        whole = gathered_split(trainer, policy, mesh_shape)[2]
        gathered = shape.layer_weights // policy.tp * (itemsize + FLOAT32) + whole * itemsize
    return activation_memory(
        shape,
        trainer.attention_kernel(),
        policy.activation_checkpointing,
        device,
        gradient_bytes=totals.grad_accumulator,
        gathered_layer_bytes=gathered,
    )


def gathered_split(
    trainer: BaseTrainer, policy: ShardingPolicy, mesh_shape: dict[str, int]
) -> tuple[int, int, int]:
    """What the step of ``policy`` gathers of the parameters its storage layout splits over
    ``batch``: the number of stacked tensors it gathers one layer at a time, the number of
    others, gathered whole where used (the token table, the head), and their elements per
    device in the compute layout."""
    per_layer, whole, whole_elements = 0, 0, 0
    for leaf in trainer.abstract_leaves:
        storage, compute = (
            partition_spec(leaf.names, trainer.plan.rules(policy, p))
            for p in ("storage", "compute")
        )
        if storage == compute:
            continue
        if leaf.path in trainer.per_layer_paths:
            per_layer += 1
            continue
        whole += 1
        whole_elements += math.prod(shard_shape(leaf.shape, compute, mesh_shape))
    return per_layer, whole, whole_elements


def gathering(
    trainer: BaseTrainer, policy: ShardingPolicy, mesh_shape: dict[str, int]
) -> str | None:
    """How the step of ``policy`` gathers the parameters its storage layout splits over
    ``batch`` (None when none are): per layer inside the model's layer scan
    (:func:`theseus.scan_layers`), or all at once before the loss, with those temporary bytes."""
    per_layer, whole, whole_elements = gathered_split(trainer, policy, mesh_shape)
    whole_bytes = whole_elements * FLOAT32
    if not per_layer and not whole:
        return None
    whole_text = f"{format_bytes(whole_bytes)} ({whole_bytes:,} bytes)"
    if not per_layer:
        return (
            f"{type(trainer).__name__} gathers all parameters at once: every microbatch moves "
            f"the {whole} tensors stored split over batch to the compute layout before the loss, "
            f"{whole_text} of temporaries per device; run stacked layers with "
            "theseus.scan_layers to gather one layer at a time"
        )
    return (
        f"gathers {per_layer} stacked tensors one layer at a time inside the layer scan; "
        f"{whole} others whole where used, {whole_text} per device"
    )


def _non_param_optimizer_bytes(trainer: BaseTrainer) -> int:
    """Bytes of the optimizer state that is not parameter-shaped (counters; kept replicated)."""
    rest = optax.tree_map_params(
        trainer.optimizer,
        lambda _: None,
        trainer.abstract_state.opt_state,
        transform_non_params=lambda x: x,
    )
    return tree_bytes(rest)


def closed_form(
    trainer: BaseTrainer, policy: ShardingPolicy, replicas: int, totals: MemoryTotals | None
) -> ClosedForm | None:
    """The ZeRO paper's model for fp32 AdamW at tp=1, or None where it does not apply (tp > 1,
    a layout that cannot be placed, parameters not float32, or not two float32 moments each)."""
    psi = trainer.num_params
    float32_params = all(np.dtype(leaf.dtype) == np.float32 for leaf in trainer.abstract_leaves)
    non_param = _non_param_optimizer_bytes(trainer)
    adam_like = tree_bytes(trainer.abstract_state.opt_state) - non_param == 8 * psi
    if policy.tp != 1 or totals is None or not (float32_params and adam_like):
        return None
    n = replicas
    formula, predicted, per_param = {
        "DP": ("16Ψ", 16 * psi, 0),
        "ZeRO": ("8Ψ + 8Ψ/N", 8 * psi + 8 * psi / n, 8),
        "FSDP": ("16Ψ/N", 16 * psi / n, 16),
    }[policy.kind]
    return ClosedForm(
        kind=policy.kind,
        formula=formula,
        psi=psi,
        replicas=n,
        predicted_bytes=float(predicted),
        planner_bytes=totals.total,
        replicated_params=replicated_share(trainer).num_params,
        bytes_per_replicated_param=per_param,
        non_param_optimizer_bytes=non_param,
    )


def _device_trainer(
    trainer_class: type[BaseTrainer], config: TrainerConfig, policy: ShardingPolicy, n: int
) -> BaseTrainer:
    available = jax.device_count()
    if n > available:
        raise ValueError(
            f"compiling for {n} devices needs {n} devices in this process, but JAX has "
            f"{available}. Run `theseus plan --compile --devices {n}` in a fresh process (it "
            f"simulates {n} CPU devices) or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts."
        )
    return trainer_class(config, policy, Topology.new(policy, devices=jax.devices()[:n]))
