"""``theseus doctor``: what a run gets on this machine, and what to fix. Registered by
:mod:`theseus.cli.app`."""

from __future__ import annotations

import contextlib
import json
from typing import Annotated

import typer

from theseus.cli.options import ProcessFlags, process_options, use_cpu_devices, user_errors


@process_options
def doctor(
    json_output: Annotated[
        bool, typer.Option("--json", help="print the report as JSON, for tools")
    ] = False,
    *,
    process: ProcessFlags,
) -> None:
    """Check this machine: JAX, devices, processes, attention kernel, MFU peak, XLA flags.

    Prints versions, the backend and its devices, how the processes are found, the attention
    kernel training gets here and whether it runs, the peak FLOP/s used for MFU and the XLA flags in effect, then
    warnings a user can act on. Exits 0 when healthy, 1 with warnings, 2 on bad input.
    """
    from theseus.distributed.join import resolve_membership

    with user_errors():
        membership = resolve_membership(
            process.distributed, process.coordinator, process.num_processes, process.process_id
        )
    with contextlib.suppress(RuntimeError):  # JAX already started (embedded use): its devices
        use_cpu_devices(process.cpu_devices)
    from theseus.accounting.records import as_json
    from theseus.training.environment import (
        environment_report,
        simulated_cpu_devices,
        system_facts,
    )

    system = system_facts()
    simulated = simulated_cpu_devices(process.cpu_devices, system.flags.get("XLA_FLAGS", ""))
    report = environment_report(system, membership, simulated_cpu_devices=simulated)
    typer.echo(json.dumps(as_json(report), indent=2) if json_output else report.describe())
    raise typer.Exit(0 if report.healthy else 1)
