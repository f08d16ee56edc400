"""What the commands of the ``theseus`` command line share: flags declared once, how a user
error becomes one paragraph and exit status 2, and how a process joins a job.

JAX reads the device configuration when its backend starts, so nothing here touches devices
before ``--cpu-devices`` has been applied; heavy imports happen inside the commands.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from theseus.distributed.join import DEFAULT_HEARTBEAT_TIMEOUT_S
from theseus.training.run.mode import RunMode

Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="dotted config overrides, e.g. training.batch_size=16 training.seq_len=64",
        show_default=False,
    ),
]
TP = Annotated[int | None, typer.Option(help="tensor-parallel devices per replica \\[default: 1]")]
Zero = Annotated[
    bool | None,
    typer.Option(help="partition optimizer state and the update over batch (ZeRO) \\[default: on]"),
]
FSDP = Annotated[
    bool | None,
    typer.Option(help="also partition stored parameters over batch; needs ZeRO \\[default: off]"),
]
ActivationCheckpointing = Annotated[
    str | None,
    typer.Option(
        metavar="none|full|dots",
        help="what each layer recomputes in the backward pass: none (keep every activation), "
        "full (the whole layer) or dots (keep the weight matmuls' outputs, recompute the rest) "
        "\\[default: none]",
    ),
]
Experts = Annotated[
    str | None,
    typer.Option(
        metavar="none|shard|batch|both",
        help="where a mixture of experts' expert index goes on the mesh: none (each expert's "
        "width is split by tp instead), shard (outputs all-reduced over shard), batch (expert "
        "parallelism across replicas: tokens sent to their experts by all-to-all) or both "
        "\\[default: none]",
    ),
]
CPUDevices = Annotated[
    int | None,
    typer.Option(help="simulate this many CPU devices (set before JAX starts)", min=1),
]
Resume = Annotated[
    bool, typer.Option("--resume", help="continue from the newest good checkpoint in the run dir")
]
AllowChanges = Annotated[
    bool, typer.Option("--allow-changes", help="with --resume: accept settings that change numbers")
]
Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite", help="replace what an earlier command wrote in the output directory"
    ),
]
Coordinator = Annotated[
    str | None,
    typer.Option(help="HOST:PORT of process 0: run as one process of a multi-process job"),
]
NumProcesses = Annotated[
    int | None, typer.Option(help="processes in the multi-process job (with --coordinator)", min=1)
]
ProcessId = Annotated[
    int | None, typer.Option(help="this process's index, 0 .. num-processes - 1", min=0)
]
Distributed = Annotated[
    str | None,
    typer.Option(
        "--distributed",
        help="auto: join the multi-process job that JAX detects (SLURM, Open MPI, Kubernetes, "
        "Cloud TPU), or run alone when there is none; off: always run alone; or one of JAX's "
        "cluster detection methods by name, e.g. mpi4py \\[default: auto]",
    ),
]
HeartbeatTimeout = Annotated[
    int | None,
    typer.Option(
        help="seconds of silence after which a peer counts as dead and the job ends "
        f"\\[default: {DEFAULT_HEARTBEAT_TIMEOUT_S}]",
        min=1,
    ),
]
Imports = Annotated[
    list[str] | None,
    typer.Option("--import", help="Python module to import first (registers your own jobs)"),
]
# The flags of the commands that read a run (evaluate, generate, export-hf).
RunJob = Annotated[
    str | None,
    typer.Option("--job", help="registered job of the run \\[default: the one the run records]"),
]
BaseRun = Annotated[
    Path | None,
    typer.Option(
        "--base",
        help="the base run of a fine-tuning (LoRA) run, when it is not where the run recorded it "
        "(checked by its fingerprints)",
    ),
]
#: The job that `train`, `plan` and `generate` use when none is named.
DEFAULT_JOB = "gpt/train/pretrain"
# `train`'s own flags and `run`'s chain file, named here like the shared ones above so that
# each command's signature reads one line a parameter.
Steps = Annotated[int | None, typer.Option(help="optimizer steps (training.steps)")]
Seed = Annotated[int | None, typer.Option(help="seed of init and data order")]
PeakTflops = Annotated[
    float | None, typer.Option(help="peak TFLOP/s per device, for MFU (logging.peak_tflops)")
]
RunDir = Annotated[Path | None, typer.Option(help="run directory \\[default: runs/<time stamp>]")]
ChainFile = Annotated[Path, typer.Argument(help="chain YAML (from `theseus configure`)")]


#: Threads of XLA:CPU's thread pools per simulated device (:func:`size_cpu_thread_pools`).
CPU_THREADS_PER_DEVICE = 4


def size_cpu_thread_pools(num_devices: int) -> None:
    """Give XLA:CPU's thread pools room for every collective that ``num_devices`` simulated
    devices can have waiting at once: ``PJRT_NPROC``, which the CPU backend reads when it starts,
    becomes ``CPU_THREADS_PER_DEVICE`` threads a device (the machine's cores if more). A value
    the user set is kept.

    By default the pools have max(cores, devices) threads. An in-process collective blocks the
    pool thread it runs on until its whole group arrives, and XLA:CPU orders a device's
    collectives only by when they start: a loop holding collectives that goes on on a pool thread
    lets the collective after it start meanwhile, so one device can wait in two at once. With 8
    devices on 2 cores such waits took all 8 threads, the work a device still had queued never
    ran, and XLA's terminate timeout aborted the process (bench/collective_deadlock.py).
    """
    threads = max(os.cpu_count() or 1, CPU_THREADS_PER_DEVICE * num_devices)
    os.environ.setdefault("PJRT_NPROC", str(threads))


def collect_garbage_less_often() -> None:
    """Python's cyclic collector waits for 20,000 new objects instead of 700. Tracing and
    compiling make millions of short-lived objects: with the default thresholds it ran 868 times
    in a tiny 16-step `theseus train` (1.1 of its 39 s of CPU), with these 115 times (0.3 s)."""
    gc.set_threshold(20_000, 20, 20)


def use_cpu_devices(count: int | None) -> None:
    """Simulate ``count`` CPU devices, with thread pools that their collectives cannot exhaust;
    must run before JAX's first operation."""
    if count is None:
        return
    size_cpu_thread_pools(count)
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


@dataclass(frozen=True)
class ProcessFlags:
    """How this process takes its place in a job: the flags a user gave, defaults filled in."""

    distributed: str = "auto"
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    cpu_devices: int | None = None


def join_job(process: ProcessFlags, out: Path | None) -> None:
    """Take this process's place in the job (before any JAX operation).

    A process of a multi-process job runs the command as a supervised worker (theseus/distributed/supervise.py)
    and exits with its status here; the worker itself, or a single process, continues.
    """
    from theseus.distributed import join, supervise

    with user_errors():
        membership = join.resolve_membership(
            process.distributed, process.coordinator, process.num_processes, process.process_id
        )
    if membership.joins and not supervise.is_worker():
        if out is None:
            fail("a multi-process run needs --out DIR: every process must write the same run")
        raise typer.Exit(supervise.supervise(sys.argv[1:], out, membership.process_id))
    supervise.set_up_worker(process.heartbeat_timeout)
    use_cpu_devices(process.cpu_devices)
    join.start(membership, process.heartbeat_timeout)


def say_processes() -> None:
    """In a job of several processes, its first line (as training says it), from process 0."""
    import jax

    if jax.process_count() > 1:
        from theseus.distributed.join import describe_processes, main_process_logger

        main_process_logger(__name__).info(describe_processes())


class _TerminalLines(logging.Handler):
    """theseus's log records as plain lines on ``sys.stdout`` (or ``sys.stderr``), looked up at
    each line: a worker's terminal or a test's captured stream gets them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.stream = "stdout"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=getattr(sys, self.stream))
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


_TERMINAL = _TerminalLines()


def show_log_lines() -> Callable[[], None]:
    """Show the ``theseus`` logger's lines (info and above) on stdout for one command; returns
    the function that undoes it (the app calls it when the command ends)."""
    logger = logging.getLogger("theseus")
    level, propagate = logger.level, logger.propagate
    _TERMINAL.stream = "stdout"
    logger.addHandler(_TERMINAL)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # said once: not again by a root handler (a worker's log file)

    def undo() -> None:
        logger.removeHandler(_TERMINAL)
        logger.setLevel(level)
        logger.propagate = propagate

    return undo


def log_lines_to_stderr() -> None:
    """Show this command's log lines on stderr: its stdout is its result (text, JSON)."""
    _TERMINAL.stream = "stderr"


def fail(message: str, code: int = 2) -> NoReturn:
    """A user error: one paragraph on stderr, no traceback, exit status ``code`` (2: bad input)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=code)


@contextlib.contextmanager
def user_errors(exit_codes: Mapping[type[Exception], int] | None = None) -> Iterator[None]:
    """Turn errors caused by the user's input into :func:`fail`: exit status 2, or the status
    ``exit_codes`` gives the error's type (e.g. 1 for a plan that found no policy)."""
    try:
        yield
    except Exception as error:
        stops = _loaded_types(
            ("theseus.training.run.stops", "RunInterrupted"),
            ("theseus.checkpoint.checkpointer", "CheckpointWriteError"),
        )
        if isinstance(error, stops):  # a status of its own (see README)
            typer.echo(f"stopped: {error}", err=True)
            # Both types define exit_code; they are matched by name so their modules stay unloaded.
            raise typer.Exit(code=error.exit_code) from None  # type: ignore[attr-defined]
        if isinstance(error, _loaded_types(("pydantic", "ValidationError"))):
            from theseus.config import describe_validation_error

            # A pydantic.ValidationError, matched by name above (pydantic stays unloaded).
            fail(describe_validation_error(error))  # type: ignore[arg-type]
        if isinstance(error, (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError)):
            code = next((c for t, c in (exit_codes or {}).items() if isinstance(error, t)), 2)
            fail(str(error), code)
        raise


def _loaded_types(*names: tuple[str, str]) -> tuple[type, ...]:
    """The named exception types whose modules are loaded: one that is not cannot have been
    raised, and importing it (orbax, pydantic) would slow every command's start."""
    modules = ((sys.modules.get(module), name) for module, name in names)
    return tuple(getattr(module, name) for module, name in modules if module is not None)


def echo_on_main(text: str) -> None:
    """Print on the first process only (every process of a multi-process job runs the CLI)."""
    from theseus.distributed.join import is_main_process

    if is_main_process():
        typer.echo(text)


def shared_options(
    options: Mapping[str, Any], *, into: str, build: Callable[..., Any]
) -> Callable[[Callable], Callable]:
    """Add the keyword ``options`` (name → ``Annotated`` type; default None) to a command, which
    receives ``build(**their values)`` as its parameter ``into``: one declaration for options
    that several commands share."""
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
        for name, kind in options.items()
    ]

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        kept = [p for p in signature.parameters.values() if p.name != into]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            built = build(**{name: kwargs.pop(name) for name in options})
            return command(**kwargs, **{into: built})

        # functools.wraps types its result without __signature__, which inspect (and typer) read.
        wrapper.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
        return wrapper

    return decorate


def sharding_changes(**given: Any) -> dict[str, Any]:
    """The sharding flags a user actually gave (others keep the chain's or default policy)."""
    return {key: value for key, value in given.items() if value is not None}


SHARDING_FLAGS = {
    "tp": TP,
    "zero": Zero,
    "fsdp": FSDP,
    "activation_checkpointing": ActivationCheckpointing,
    "experts": Experts,
}
#: --tp, --zero/--no-zero, --fsdp/--no-fsdp, --activation-checkpointing POLICY, --experts
#: PLACEMENT: the command receives the policy changes the user gave as ``sharding``.
sharding_options = shared_options(SHARDING_FLAGS, into="sharding", build=sharding_changes)
#: The layout flags alone (for commands that do not train).
layout_options = shared_options(
    {flag: SHARDING_FLAGS[flag] for flag in ("tp", "zero", "fsdp", "experts")},
    into="sharding",
    build=sharding_changes,
)


InitFrom = Annotated[
    Path | None,
    typer.Option(
        help="start from this run's newest parameters (a run directory or `theseus import-hf`); "
        "fresh optimizer and schedule"
    ),
]
RUN_FLAGS = {
    "resume": Resume,
    "allow_changes": AllowChanges,
    "overwrite": Overwrite,
    "init_from": InitFrom,
}
PROCESS_FLAGS = {
    "distributed": Distributed,
    "coordinator": Coordinator,
    "num_processes": NumProcesses,
    "process_id": ProcessId,
    "heartbeat_timeout": HeartbeatTimeout,
    "cpu_devices": CPUDevices,
}


@dataclass(frozen=True)
class JobFlags:
    """The flags of every training command: the policy changes given (``sharding``), what to do
    with an existing run (``run``) and how this process joins a job (``process``)."""

    sharding: dict[str, Any]
    run: RunMode
    process: ProcessFlags


def job_flags(**given: Any) -> JobFlags:
    def picked(flags: Mapping[str, Any]) -> dict[str, Any]:
        return sharding_changes(**{flag: given[flag] for flag in flags})

    with user_errors():  # e.g. --resume with --overwrite
        switches = {flag: bool(given[flag]) for flag in RUN_FLAGS if flag != "init_from"}
        run = RunMode(**switches, init_from=given["init_from"])
    return JobFlags(
        sharding=picked(SHARDING_FLAGS), run=run, process=ProcessFlags(**picked(PROCESS_FLAGS))
    )


def process_flags(**given: Any) -> ProcessFlags:
    return ProcessFlags(**sharding_changes(**given))


#: The process flags alone, for a command that is not a training job but may run in many
#: processes (`import-hf`): it receives them as ``process`` (a :class:`ProcessFlags`).
process_options = shared_options(PROCESS_FLAGS, into="process", build=process_flags)


#: The sharding flags, --resume/--allow-changes/--overwrite/--init-from and the process flags (--distributed,
#: --coordinator, --num-processes, --process-id, --heartbeat-timeout, --cpu-devices), declared
#: once for `train` and `run`, which receive them as ``flags`` (a :class:`JobFlags`).
job_options = shared_options(
    {**SHARDING_FLAGS, **RUN_FLAGS, **PROCESS_FLAGS}, into="flags", build=job_flags
)


def import_modules(modules: list[str] | None) -> None:
    """Import the user's modules (which register jobs); the working directory is searched too."""
    import importlib

    if modules and "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    for module in modules or ():
        importlib.import_module(module)
