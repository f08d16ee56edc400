"""Joining a multi-process job: explicit addresses or JAX's own cluster detection, the run's first
line, and checks that every process sees the same inputs.

Detection is JAX's (``jax/_src/clusters``: SLURM, Open MPI, Kubernetes, Cloud TPU, mpi4py when
asked): :func:`detect_cluster` applies the rule ``jax.distributed.initialize`` applies itself, only
to name the cluster kind and to know, before starting, how many processes the job has. A cluster
of one process (an interactive allocation) runs without the distributed runtime.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_HEARTBEAT_TIMEOUT_S = 30
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


@dataclass(frozen=True)
class Membership:
    """This process's place in the job, known before JAX starts.

    ``kind`` is ``"explicit"`` (``--coordinator``), a JAX cluster name (``"slurm"``, ``"ompi"``,
    ...) or ``None`` for a single process outside any detected cluster. ``coordinator`` is set only
    for explicit membership; a detected cluster's address is JAX's to find.
    """

    kind: str | None
    num_processes: int
    process_id: int
    coordinator: str | None = None
    method: str | None = None  # the detection method named by the user (None: JAX's choice)

    @property
    def joins(self) -> bool:
        """Whether this process joins a job of several processes (the distributed runtime)."""
        return self.num_processes > 1


# The job this process joined through :func:`start`, if any.
_joined: Membership | None = None


def cluster_environments() -> dict[str, Any]:
    """JAX's cluster environments (``ClusterEnv`` classes) by name, in JAX's order of detection."""
    from jax._src import clusters  # JAX's own detection; importing it does not start JAX

    # Some environments have no name in some JAX versions (Kubernetes in 0.10): use the class's.
    return {env.name or env.__name__: env for env in clusters.ClusterEnv._cluster_types}


def detect_cluster() -> Any | None:
    """JAX's cluster environment this process runs in, or None.

    The same choice as ``jax.distributed.initialize()`` without arguments makes: the first
    registered environment that is not opt-in (mpi4py is) and is present.
    """
    for env in cluster_environments().values():
        if not env.opt_in_only_method and env.is_env_present():
            return env
    return None


def named_cluster(name: str) -> Any:
    """The JAX cluster environment ``name`` (e.g. ``mpi4py``); ValueError when absent here."""
    environments = cluster_environments()
    if name not in environments:
        raise ValueError(
            f"--distributed must be auto, off or one of JAX's cluster detection methods "
            f"{sorted(environments)}, got {name!r}"
        )
    if not environments[name].is_env_present():
        raise ValueError(
            f"--distributed {name}: JAX does not find a {name} environment in this process; "
            "start it through that launcher, or use --distributed auto"
        )
    return environments[name]


def resolve_membership(
    mode: str,
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
) -> Membership:
    """How this process takes part, from the CLI's flags; ValueError on contradictory input.

    ``mode`` is ``auto`` (JAX's detection), ``off`` (never join) or the name of one of JAX's
    cluster detection methods (``slurm``, ``ompi``, ``mpi4py``, ...).
    """
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            raise ValueError("--num-processes and --process-id need --coordinator HOST:PORT")
        if mode == "off":
            return Membership(None, 1, 0)
        env = detect_cluster() if mode == "auto" else named_cluster(mode)
        if env is None:
            return Membership(None, 1, 0)
        kind = env.name or env.__name__
        method = None if mode == "auto" else env.name
        return Membership(kind, env.get_process_count(), env.get_process_id(), method=method)
    if mode != "auto":
        raise ValueError(f"--distributed {mode} contradicts --coordinator; drop one of them")
    if num_processes is None or process_id is None:
        raise ValueError("--coordinator needs --num-processes and --process-id")
    if process_id >= num_processes:
        raise ValueError(f"--process-id {process_id} is not below --num-processes {num_processes}")
    if ":" not in coordinator:
        raise ValueError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    return Membership("explicit", num_processes, process_id, coordinator)


def start(membership: Membership, heartbeat_timeout_s: int) -> None:
    """Join the job through ``jax.distributed`` (before any JAX operation); no-op alone.

    A peer that sends no heartbeat for ``heartbeat_timeout_s`` seconds ends every process.
    """
    global _joined
    if not membership.joins:
        return
    import jax

    if membership.kind == "explicit":
        assert membership.coordinator is not None  # an explicit membership names it
        host = membership.coordinator.rsplit(":", 1)[0]
        jax.distributed.initialize(
            coordinator_address=membership.coordinator,
            num_processes=membership.num_processes,
            process_id=membership.process_id,
            # On one machine the coordinator listens on loopback only.
            coordinator_bind_address=membership.coordinator if host in LOOPBACK_HOSTS else None,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    else:
        jax.distributed.initialize(
            cluster_detection_method=membership.method,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    if (jax.process_count(), jax.process_index()) != (
        membership.num_processes,
        membership.process_id,
    ):
        raise RuntimeError(
            f"JAX joined as process {jax.process_index()} of {jax.process_count()}, but the "
            f"{membership.kind} environment announced {membership.process_id} of "
            f"{membership.num_processes}"
        )
    _joined = membership


def is_main_process() -> bool:
    """Whether this is the job's first process: the one that writes run records and prints (all
    processes compute and checkpoint)."""
    import jax

    return jax.process_index() == 0


class _MainProcessOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_main_process()


def main_process_logger(name: str) -> logging.Logger:
    """The logger ``name`` (a module's ``__name__``), passing records on the main process only:
    for lines every process of a job would say alike (a run's progress, a restore's verdict)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _MainProcessOnly) for f in logger.filters):
        logger.addFilter(_MainProcessOnly())
    return logger


def describe_processes() -> str:
    """The run's first line: cluster kind, process index and count, local devices."""
    import jax

    local = jax.local_devices()
    kinds = sorted({d.platform for d in local})
    if _joined is not None:
        how = {"explicit": f"coordinator {_joined.coordinator}"}.get(
            str(_joined.kind), f"{_joined.kind} cluster detected"
        )
    else:
        how = "no cluster detected" if jax.process_count() == 1 else "started by the caller"
    return (
        f"processes: {jax.process_index()} of {jax.process_count()} ({how}); "
        f"{len(local)} local {'/'.join(kinds)} device(s) of {jax.device_count()}"
    )


# --- same inputs on every process ------------------------------------------------------------


def differing_processes(rows: np.ndarray) -> list[int]:
    """Indices of the processes whose row differs from process 0's (rows: (processes, k))."""
    return [i for i in range(1, len(rows)) if not np.array_equal(rows[i], rows[0])]


def check_same_everywhere(what: str, facts: dict[str, int]) -> None:
    """Stop at start, on every process, when processes disagree on ``facts`` (small integers).

    ``what`` names the input (e.g. "corpus"); the error names the processes that differ from
    process 0 and shows each one's facts.
    """
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    row = np.array(list(facts.values()), dtype=np.int64)  # (k,)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)
    differing = differing_processes(rows)
    if differing:
        raise ValueError(mismatch_message(what, list(facts), rows, differing))


def mismatch_message(what: str, names: list[str], rows: np.ndarray, differing: list[int]) -> str:
    """One paragraph: which processes' ``what`` differs from process 0's, with their facts."""
    shown = [0, *differing]
    facts = "; ".join(
        f"process {i}: " + ", ".join(f"{n} {v}" for n, v in zip(names, rows[i], strict=True))
        for i in shown
    )
    return (
        f"the processes do not see the same {what}: process(es) {differing} differ from process "
        f"0 ({facts}). Every process must read identical data: give each host the same files "
        "(same path, same contents) and start again."
    )
