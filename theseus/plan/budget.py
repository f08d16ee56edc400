"""Choose the policy with the least communication that fits a per-device memory budget."""

from __future__ import annotations

import dataclasses
from typing import TypedDict, Unpack

from theseus.accounting.memory import format_bytes
from theseus.config import apply_overrides
from theseus.plan.build import plan
from theseus.plan.policies import candidate_policies
from theseus.plan.results import BudgetChoice, NoPolicyFits, Plan, PolicyOption, Reason
from theseus.sharding.axis import Remat, ShardingPolicy
from theseus.training.trainer import BaseTrainer, TrainerConfig


class BudgetOptions(TypedDict, total=False):
    devices_per_host: int | None  # devices of one host (default: min(devices, 8))
    activation_checkpointing: Remat  # of every candidate policy (default: "none")
    compile: bool  # also fit by the compiled peak, activations included (default: False)


def plan_for_budget(
    trainer_class: type[BaseTrainer],
    config: TrainerConfig,
    num_devices: int,
    budget: int,
    **options: Unpack[BudgetOptions],
) -> Plan:
    """The plan of the valid policy with the least communication whose per-device memory fits in
    ``budget`` bytes, saying why each other policy was not chosen (``options``: see
    :class:`BudgetOptions`).

    Memory is the model state (parameters, gradient accumulator, optimizer state) plus one
    microbatch's activations (:mod:`theseus.accounting.activations`); with
    ``compile=True`` a policy must also fit by its compiled peak (activations included), and of
    the compiled candidates that fit, the one whose step moves the fewest collective bytes wins
    (ties: the communication order). Raises :class:`NoPolicyFits` listing every
    policy's reason when none fits.
    """
    devices_per_host = options.get("devices_per_host")
    compile = options.get("compile", False)
    if budget <= 0:
        raise ValueError(f"the memory budget must be positive; got {budget} bytes.")
    policies = candidate_policies(
        num_devices,
        devices_per_host,
        activation_checkpointing=options.get("activation_checkpointing") or "none",
    )
    survey = plan(
        trainer_class, config, policies[0], num_devices, devices_per_host=devices_per_host
    )
    measure = "compiled peak" if compile else "model state and activations"
    reasons: dict[str, str] = {}
    fitting: list[Plan] = []  # compiled plans that fit, ranked by their collectives
    for option in survey.options:
        name = option.name
        if not option.verdict.ok:
            reasons[name] = f"invalid: {option.verdict.summary}"
            continue
        total = _total(option)
        if total > budget:
            reasons[name] = f"{_needs(option)} > budget"
            continue
        if fitting and not compile:  # uncompiled, the communication order decides
            reasons[name] = (
                f"fits ({format_bytes(total)}) but communicates more than {fitting[0].name}"
            )
            continue
        candidate = survey
        if compile or option.policy != survey.policy:
            candidate = plan(
                trainer_class,
                config,
                option.policy,
                num_devices,
                devices_per_host=devices_per_host,
                compile=compile,
                compare_remat=False,  # each candidate under its own recompute policy
                device_memory=budget,
            )
        if not candidate.verdict.ok:
            reasons[name] = f"invalid: {candidate.verdict.summary}"
        elif compile and candidate.compiled is not None and candidate.compiled.peak > budget:
            reasons[name] = f"compiled peak needs {format_bytes(candidate.compiled.peak)} > budget"
        else:
            fitting.append(candidate)
    # Compiled, the least collective bytes per step wins (ties: the communication order).
    chosen = min(fitting, key=_communicated, default=None)
    for candidate in fitting:
        assert chosen is not None  # the least of a list that has this candidate
        reasons[candidate.name] = (
            f"chosen: {measure} {format_bytes(_measure(candidate))} fits"
            if candidate is chosen
            else f"fits ({format_bytes(_measure(candidate))}) but its step moves "
            f"{format_bytes(_communicated(candidate))} of collectives, more than {chosen.name}"
        )
    ordered = tuple(Reason(o.name, reasons[o.name]) for o in survey.options if o.name in reasons)
    if chosen is None:
        lines = "; ".join(f"{name}: {why}" for name, why in ordered)
        raise NoPolicyFits(
            f"no valid policy fits {num_devices} devices in {format_bytes(budget)} per device "
            f"({measure}): {lines}. Add devices, raise the budget, or shrink the model "
            "(recomputation and a smaller per-device batch lower the activations: "
            "`theseus train --budget` chooses those too)."
        )
    choice = BudgetChoice(budget, measure, chosen.name, ordered)
    return dataclasses.replace(chosen, budget=choice, device_memory=budget)


def _total(option: PolicyOption) -> int:
    """A valid option's model state and activations per device (a valid option has totals)."""
    total = option.total
    assert total is not None, f"the valid policy {option.name} has no memory totals"
    return total


def _needs(option: PolicyOption) -> str:
    """What ``option`` needs per device, in words: the model state, and the activations when
    they are known (an RL job's: and its rollout)."""
    assert option.totals is not None  # only valid options are described
    state = f"model state needs {format_bytes(option.totals.total)}"
    if option.activations is not None:
        state = f"{state} + activations {format_bytes(option.activations.total)}"
    if option.rollout is None:
        return state
    rollout = option.totals.persistent + option.rollout.generation
    return f"the larger of its step ({state}) and its rollout ({format_bytes(rollout)})"


def _communicated(plan_: Plan) -> int:
    """Collective bytes per device per step when compiled; 0 otherwise (order decides)."""
    return plan_.compiled.collectives.bytes if plan_.compiled is not None else 0


def _measure(plan_: Plan) -> int:
    if plan_.compiled is not None:
        return plan_.compiled.peak
    assert plan_.total is not None  # only valid plans are measured
    return plan_.total


#: Recompute policies from the least recomputation to the most: a step that fits without
#: recomputing is chosen before one that recomputes.
RECOMPUTE_ORDER: tuple[Remat, ...] = ("none", "dots", "full")


def plan_training_for_budget(
    trainer_class: type[BaseTrainer],
    config: TrainerConfig,
    num_devices: int,
    budget: int,
    *,
    devices_per_host: int | None = None,
) -> Plan:
    """The plan ``theseus train --budget`` runs: of every valid policy (least communication
    first), recompute policy (least recomputation first) and per-device batch (largest first,
    at most ``training.per_device_batch_size``; the global batch stays, accumulation grows), the
    first whose model state and one microbatch's activations fit in ``budget`` bytes per
    device. Its config is the chosen per-device batch and its policy the chosen one; its
    ``budget`` says why each other policy was not chosen. Raises :class:`NoPolicyFits` when
    nothing fits."""
    if budget <= 0:
        raise ValueError(f"the memory budget must be positive; got {budget} bytes.")
    largest = config.training.per_device_batch_size
    surveys = {  # (recompute, examples per device) -> every policy's plan side by side
        (remat, size): plan(
            trainer_class,
            _with_batch(config, size),
            ShardingPolicy(activation_checkpointing=remat),
            num_devices,
            devices_per_host=devices_per_host,
        )
        for remat in RECOMPUTE_ORDER
        for size in range(largest, 0, -1)
    }
    first = surveys["none", largest]
    reasons: dict[str, str] = {}
    for rank, option in enumerate(first.options):
        tried = [(key, s.options[rank]) for key, s in surveys.items()]
        valid = [(key, o) for key, o in tried if o.verdict.ok]
        fits = [(key, o) for key, o in valid if _total(o) <= budget]
        if fits:
            (remat, size), chosen = fits[0]
            reasons[chosen.name] = (
                f"chosen: recompute {remat}, {size} examples per device, "
                f"{_needs(chosen)} = {format_bytes(_total(chosen))} fits"
            )
            result = plan(
                trainer_class,
                _with_batch(config, size),
                chosen.policy,
                num_devices,
                devices_per_host=devices_per_host,
                device_memory=budget,
            )
            later = {
                o.name: f"not tried: communicates more than {chosen.name}"
                for o in first.options[rank + 1 :]
            }
            ordered = tuple(Reason(name, why) for name, why in (reasons | later).items())
            choice = BudgetChoice(budget, "model state and activations", chosen.name, ordered)
            return dataclasses.replace(result, budget=choice)
        if not valid:
            reasons[option.name] = f"invalid: {option.verdict.summary}"
            continue
        least = min(valid, key=lambda item: _total(item[1]))[1]
        reasons[option.name] = (
            f"even with recompute {least.policy.activation_checkpointing} and "
            f"{_examples(least)} per device, {_needs(least)} > budget"
        )
    lines = "; ".join(f"{name}: {why}" for name, why in reasons.items())
    raise NoPolicyFits(
        f"nothing fits {num_devices} devices in {format_bytes(budget)} per device (model state "
        f"and one microbatch's activations, under every policy, recompute policy and "
        f"per-device batch from {largest} down to 1): {lines}. Add devices, raise the budget, "
        "shorten training.seq_len or shrink the model."
    )


def _with_batch(config: TrainerConfig, size: int) -> TrainerConfig:
    return apply_overrides(config, [f"training.per_device_batch_size={size}"])


def _examples(option: PolicyOption) -> str:
    if option.activations is None:
        return "the configured examples"
    return f"{option.activations.examples} examples"
