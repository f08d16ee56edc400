"""``theseus launch``: the command line of :mod:`theseus.distributed.launch`. Registered by :mod:`theseus.cli.app`."""

from __future__ import annotations

from typing import Annotated

import typer

from theseus.cli.options import user_errors
from theseus.distributed.launch import LAUNCHABLE


def launch(
    command: Annotated[
        list[str],
        typer.Argument(
            help="after --, the theseus command every process runs: "
            + ", ".join(f"{name} ..." for name in LAUNCHABLE),
            show_default=False,
        ),
    ],
    processes: Annotated[
        int, typer.Option("-n", "--processes", help="processes to start on this machine", min=1)
    ],
    cpu_devices_per_process: Annotated[
        int | None, typer.Option(help="simulate this many CPU devices in each process", min=1)
    ] = None,
) -> None:
    """Start P joined processes of one command on this machine (to try multi-process runs).

    Output lines carry the process index; when one process fails, the others are stopped and the
    launcher exits with its status. On a cluster, the scheduler starts the processes (srun,
    mpirun) and `theseus train` joins them by itself.
    """
    with user_errors():
        from theseus.distributed.launch import launch as launch_processes

        status = launch_processes(command, processes, cpu_devices_per_process)
    raise typer.Exit(status)
