"""Choose the policy with the least communication that fits a per-device memory budget."""

from __future__ import annotations

import dataclasses
from typing import TypedDict, Unpack

from theseus.accounting.memory import format_bytes
from theseus.plan.build import plan
from theseus.plan.policies import candidate_policies
from theseus.plan.results import BudgetChoice, NoPolicyFits, Plan, Reason
from theseus.sharding.axis import Remat
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

    Memory is the model state (parameters, gradient accumulator, optimizer state); with
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
    measure = "compiled peak" if compile else "model state"
    reasons: dict[str, str] = {}
    fitting: list[Plan] = []  # compiled plans that fit, ranked by their collectives
    for option in survey.options:
        name = option.name
        if not option.verdict.ok:
            reasons[name] = f"invalid: {option.verdict.summary}"
            continue
        assert option.totals is not None  # a valid plan has its totals
        total = option.totals.total
        if total > budget:
            reasons[name] = f"model state needs {format_bytes(total)} > budget"
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
            "(activation checkpointing lowers activations only)."
        )
    choice = BudgetChoice(budget, measure, chosen.name, ordered)
    return dataclasses.replace(chosen, budget=choice)


def _communicated(plan_: Plan) -> int:
    """Collective bytes per device per step when compiled; 0 otherwise (order decides)."""
    return plan_.compiled.collectives.bytes if plan_.compiled is not None else 0


def _measure(plan_: Plan) -> int:
    if plan_.compiled is not None:
        return plan_.compiled.peak
    assert plan_.totals is not None  # only valid plans are measured
    return plan_.totals.total
