"""``theseus plan``: every layout and the per-device memory for any mesh, from shapes only.
Registered by :mod:`theseus.cli.app`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from theseus.cli.options import (
    DEFAULT_JOB,
    Imports,
    import_modules,
    sharding_options,
    use_cpu_devices,
    user_errors,
)


@sharding_options
def plan_command(
    arguments: Annotated[
        list[str] | None,
        typer.Argument(
            help=f"optional JOB (a registered job, default {DEFAULT_JOB}) or CONFIG.yaml (a "
            f"chain from `theseus configure`, or a config of {DEFAULT_JOB}), then dotted config "
            "overrides",
            show_default=False,
        ),
    ] = None,
    devices: Annotated[
        int | None,
        typer.Option(help="devices to plan for, any number [default: this machine's]", min=1),
    ] = None,
    devices_per_host: Annotated[
        int | None,
        typer.Option(help="devices of one host; TP stays within a host [default: min(devices, 8)]"),
    ] = None,
    compile_step: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="also compile the real train step on that many simulated CPU devices and show "
            "its memory_analysis() (activations included), under every recompute policy side by "
            "side, or under the one --activation-checkpointing names",
        ),
    ] = False,
    budget: Annotated[
        str | None,
        typer.Option(
            help="per-device memory, e.g. 80GiB: pick the valid policy with the least "
            "communication that fits (instead of --tp/--zero/--fsdp)"
        ),
    ] = None,
    device_memory: Annotated[
        str | None,
        typer.Option(
            help="memory of one device, e.g. 80GiB: the verdict fails when the model state plus "
            "one microbatch's activations does not fit [default: this machine's accelerator's, "
            "when it reports one]"
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="print the plan as JSON, for tools")
    ] = False,
    hf: Annotated[
        Path | None,
        typer.Option(
            "--hf",
            help="plan a published model: its Hugging Face config.json (or the folder holding "
            "it) gives the model section (no weights read); the job defaults to its family's; "
            "overrides apply on top",
        ),
    ] = None,
    imports: Imports = None,
    *,
    sharding: dict[str, Any],
) -> None:
    """Plan before you train: every layout and the per-device memory, from shapes only.

    Exits 1 when the pre-flight check fails or no policy fits the budget, 2 on bad input.
    """
    if compile_step:
        with contextlib.suppress(RuntimeError):  # JAX already started (embedded use): its
            use_cpu_devices(devices)  # devices are checked when compiling
    import json

    from theseus.plan import NoPolicyFits

    rest = list(arguments or [])
    source = rest.pop(0) if rest and "=" not in rest[0] else None
    with user_errors(exit_codes={NoPolicyFits: 1}):
        import_modules(imports)
        from theseus.accounting.records import as_json
        from theseus.config import apply_overrides
        from theseus.plan import parse_bytes, plan, plan_for_budget, render

        chosen = plan_source(source or DEFAULT_JOB) if hf is None else hf_source(hf, source)
        trainer_class, policy = chosen.trainer_class, chosen.policy
        config = apply_overrides(chosen.config, rest)
        if devices is None:
            import jax

            devices = jax.device_count()
        if budget is None:
            result = plan(
                trainer_class,
                config,
                policy.merge(**sharding),
                devices,
                devices_per_host=devices_per_host,
                compile=compile_step,
                # A recompute policy the user named is the one compiled; else all, side by side.
                compare_remat="activation_checkpointing" not in sharding,
                device_memory=local_memory()
                if device_memory is None
                else parse_bytes(device_memory),
            )
        elif device_memory is not None:
            raise ValueError(
                "--budget is the per-device memory the plan must fit; drop --device-memory."
            )
        elif {"tp", "zero", "fsdp"} & set(sharding):
            raise ValueError(
                "--budget chooses the policy itself; drop --tp, --zero/--no-zero and "
                "--fsdp/--no-fsdp (or drop --budget to plan one policy)."
            )
        else:
            result = plan_for_budget(
                trainer_class,
                config,
                devices,
                parse_bytes(budget),
                devices_per_host=devices_per_host,
                activation_checkpointing=policy.merge(**sharding).activation_checkpointing,
                compile=compile_step,
            )
    typer.echo(json.dumps(as_json(result), indent=2) if json_output else render(result))
    if not result.verdict.ok:
        raise typer.Exit(code=1)


def local_memory() -> int | None:
    """The memory of this machine's first accelerator when JAX reports it (None on CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


@dataclass(frozen=True)
class PlanSource:
    """What ``theseus plan SOURCE`` plans: a trainer class, its config and a policy."""

    trainer_class: type
    config: Any
    policy: Any


def hf_source(path: Path, job: str | None) -> PlanSource:
    """What ``theseus plan --hf PATH [JOB]`` plans: the model of a Hugging Face config under its
    family's training job (or ``job``, one of that family's)."""
    from theseus.hf.config import job_for, read_config, with_model
    from theseus.jobs import get_job
    from theseus.sharding.axis import ShardingPolicy

    if job is not None and job.endswith((".yaml", ".yml")):
        raise ValueError(
            f"--hf gives the model; a chain YAML ({job}) gives its own. Drop one of them."
        )
    spec = read_config(path)
    trainer_class = get_job(job_for(spec, job)).trainer_class
    config = with_model(trainer_class.config_class(), spec)
    return PlanSource(trainer_class, config, ShardingPolicy())


def plan_source(source: str) -> PlanSource:
    """The source of ``theseus plan SOURCE``: a registered job, a chain YAML (its first step and
    its policy) or a config YAML of the default job."""
    from theseus.config import read_yaml, validate
    from theseus.execution import Chain
    from theseus.jobs import get_job
    from theseus.sharding.axis import ShardingPolicy

    if not (source.endswith((".yaml", ".yml")) or Path(source).is_file()):
        trainer_class = get_job(source).trainer_class
        return PlanSource(trainer_class, trainer_class.config_class(), ShardingPolicy())
    data = read_yaml(source)
    if isinstance(data, dict) and "steps" in data:
        chain = Chain.from_dict(data, where=source)
        first = chain.steps[0]
        return PlanSource(get_job(first.job).trainer_class, first.config, chain.policy)
    gpt = get_job(DEFAULT_JOB).trainer_class
    return PlanSource(gpt, validate(gpt.config_class, data or {}), ShardingPolicy())
