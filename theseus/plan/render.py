"""A plan as text: what ``theseus plan`` prints (its JSON is ``as_json(plan)``)."""

from __future__ import annotations

from theseus.accounting.memory import CompiledStep, format_bytes
from theseus.accounting.text import mesh_text, number_text, percent, shape_text, text_table
from theseus.plan.policies import COMMUNICATION, expert_exchange
from theseus.plan.results import BudgetChoice, Plan, RematOption, memory_sum
from theseus.sharding.axis import Axis
from theseus.training.summary import REPLICATED_WARNING_SHARE, ReplicatedShare, layout_table

_num = number_text


def render(p: Plan) -> str:
    lines = [
        f"plan: {p.trainer}, {_num(p.num_params)} parameters on {p.num_devices} devices "
        f"({p.devices_per_host} per host), mesh {mesh_text(p.mesh_shape)}",
        f"policy: {p.name} ({p.policy.describe()})",
    ]
    if p.batch:
        lines.append(p.batch)
    lines += ["", *layout_table(p.rows), "", *_memory(p)]
    lines += ["", p.closed_form.describe()] if p.closed_form is not None else []
    lines += ["", *_replicated(p.replicated, p)] if p.replicated is not None else []
    lines += ["", *_compiled(p.compiled)] if p.compiled is not None else []
    lines += [p.compiled_rollout.describe()] if p.compiled_rollout is not None else []
    lines += ["", *_remat(p.remat, p.policy.activation_checkpointing)] if p.remat else []
    lines += ["", *_budget(p.budget)] if p.budget is not None else []
    return "\n".join([*lines, "", *_verdict(p)])


def _memory(p: Plan) -> list[str]:
    rl = any(option.rollout is not None for option in p.options)  # an RL job's plan
    lines = [
        "per-device memory in bytes: model state (parameters as stored, float32 gradient "
        "accumulator, optimizer state) and the activations of one microbatch"
        + (
            "; the rollout: parameters and optimizer state and what the generation holds; peak: "
            "the larger of the training step (with its completion rows) and the rollout"
            if rl
            else ""
        )
    ]
    header = ["", "policy", "mesh", "params", "gradient sum", "optimizer", "model state"]
    header += ["activations", "rollout", "peak"] if rl else ["activations", "sum"]
    header.append("verdict")
    table = []
    for option in p.options:
        mark = "*" if option.policy == p.policy else ""
        mesh = f"{option.mesh_shape[Axis.BATCH]}×{option.mesh_shape[Axis.SHARD]}"
        cells = ["-"] * (7 if rl else 6)
        if option.totals is not None:
            t, acts, rollout = option.totals, option.activations, option.rollout
            cells = [_num(t.params), _num(t.grad_accumulator), _num(t.optimizer), _num(t.total)]
            cells.append("-" if acts is None else format_bytes(acts.total))
            if rl:
                generation = None if rollout is None else t.persistent + rollout.generation
                cells.append("-" if generation is None else format_bytes(generation))
            cells.append(format_bytes(memory_sum(t, acts, rollout)))
        summary = option.verdict.summary
        summary = summary if len(summary) <= 72 else summary[:71] + "…"
        table.append([mark, option.name, mesh, *cells, summary])
    lines += text_table(header, table)
    lines.append(
        "  communication, least first: DP < ZeRO < FSDP at tp=1, then each tp > 1 in the same "
        "order (" + "; ".join(f"{k}: {v}" for k, v in COMMUNICATION.items()) + ")"
    )
    if p.policy.experts != "none":
        lines.append(f"  {p.policy.name}{expert_exchange(p.policy)}")
    return [*lines, *_activations(p), *_rollout(p)]


def _activations(p: Plan) -> list[str]:
    a = p.activations
    if a is None:
        return [
            "  activations: not estimated (the model is not a decoder the planner knows, or the "
            "batch does not split); --compile measures them"
        ]
    lines = [
        f"activations of {p.name}, one microbatch per device ({a.kernel} attention, recompute "
        f"{a.remat}): {format_bytes(a.total)} ({_num(a.total)} bytes) = kept for the backward "
        f"{format_bytes(a.saved)} + the larger of one layer's backward peak "
        f"{format_bytes(a.layer_peak)} and the logits and loss {format_bytes(a.logits)} (in "
        f"chunks of {_num(a.loss_chunk)} positions; freed before the layers' backward) + other "
        f"{format_bytes(a.other)}"
    ]
    if a.unpredicted is not None:
        gathered = f" ({format_bytes(a.gathered)} gathered)" if a.gathered else ""
        lines.append(
            f"  not predicted: {a.unpredicted}{gathered}, counted whole; how much of them the "
            "compiled step holds at its peak depends on XLA's schedule (up to 1.32x over at "
            "2,048 tokens a device with recompute, within 5% at 32,768; --compile measures it)"
        )
    if p.device_memory is not None and p.rollout is None:
        assert p.total is not None  # activations are estimated with the model state only
        lines.append(
            f"  sum {format_bytes(p.total)} per device against {format_bytes(p.device_memory)} "
            "of device memory"
        )
    return lines


def _rollout(p: Plan) -> list[str]:
    """An RL job's rollout and the peak of its step."""
    r, t = p.rollout, p.totals
    if r is None or t is None:
        return []
    step = t.total + r.batch + (0 if p.activations is None else p.activations.total)
    assert p.total is not None  # a rollout is planned with the model state only
    lines = [
        f"rollout of {p.name}, {_num(r.rows)} completions a generation batch "
        f"({_num(r.rows_per_device)} per device): {format_bytes(r.generation)} "
        f"({_num(r.generation)} bytes) beyond the parameters and optimizer state = {r.describe()}",
        f"  peak {format_bytes(p.total)} per device: the larger of the training step "
        f"{format_bytes(step)} (model state, activations and its completion rows "
        f"{format_bytes(r.batch)}) and the rollout {format_bytes(t.persistent + r.generation)} "
        "(parameters, optimizer state and the generation)",
    ]
    if p.device_memory is not None:
        lines.append(
            f"  peak {format_bytes(p.total)} per device against "
            f"{format_bytes(p.device_memory)} of device memory"
        )
    return lines


def _replicated(r: ReplicatedShare, p: Plan) -> list[str]:
    lines = [
        f"replicated across batch: {percent(r.fraction)} of parameters ({_num(r.num_params)} of "
        f"{_num(r.total_params)}) are left whole on every replica by the plan's ZeRO rules"
        + ("" if p.policy.zero else " (zero=False replicates all optimizer state by choice)"),
    ]
    if r.largest:
        lines.append(
            f"  above {REPLICATED_WARNING_SHARE:.0%}; largest: "
            + ", ".join(f"{t.path} {shape_text(t.shape)} ({_num(t.params)})" for t in r.largest)
            + "; annotate them with logical names the ZeRO rules map to batch"
        )
    return lines


def _compiled(c: CompiledStep) -> list[str]:
    table = [
        [op, _num(total.count), _num(total.bytes), format_bytes(total.bytes)]
        for op, total in c.collectives.items()
    ]
    return [
        c.describe(),
        "collectives per device per step (loops unrolled):",
        *text_table(["collective", "count", "bytes", ""], table),
    ]


def _remat(options: tuple[RematOption, ...], chosen: str) -> list[str]:
    least = min(o.dot_flops for o in options) or 1
    table = [
        [
            f"{o.remat}{' (this plan)' if o.remat == chosen else ''}",
            format_bytes(o.peak),
            format_bytes(o.temporaries),
            _num(o.dot_flops),
            f"{o.dot_flops / least:.3f}",
            format_bytes(o.all_gather),
        ]
        for o in options
    ]
    header = ["recompute", "peak", "temporaries", "matmul FLOPs", "× least", "all-gather"]
    return [
        "recompute policies (--activation-checkpointing), compiled step per device per step; "
        "FLOPs include recomputation:",
        *text_table(header, table),
    ]


def _budget(b: BudgetChoice) -> list[str]:
    return [
        (
            f"budget {format_bytes(b.budget)} ({_num(b.budget)} bytes) per device, by "
            f"{b.measure}: chose {b.chosen}, the least communication that fits"
        ),
        *(f"  {name}: {why}" for name, why in b.reasons),
    ]


def _verdict(p: Plan) -> list[str]:
    if p.verdict.ok:
        gathering = [f"  {p.verdict.gathering}"] if p.verdict.gathering else []
        memory = []
        if p.device_memory is not None and p.total is not None:
            memory = [
                f"  memory: {format_bytes(p.total)} per device fits in "
                f"{format_bytes(p.device_memory)}"
            ]
        elif p.total is not None:
            what = "model state and activations"
            what = "the larger of the training step and the rollout" if p.rollout else what
            memory = [
                f"  memory: {format_bytes(p.total)} per device ({what}), "
                "not checked against a device: pass --device-memory (e.g. 80GiB)"
            ]
        return ["verdict: ok (the pre-flight check of a training run passes)", *gathering, *memory]
    lines = ["verdict: FAILED, a training run would stop with:"]
    lines += ["  " + line for line in (p.verdict.error or "").splitlines()]
    if p.verdict.also:
        lines.append("and, once that is fixed, the layout check would stop it with:")
        lines += ["  " + line for line in p.verdict.also.splitlines()]
    return lines
