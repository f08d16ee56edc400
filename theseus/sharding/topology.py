"""The device mesh: ``(batch, shard)`` of shape ``(num_devices // tp, tp)``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from theseus.sharding.axis import MESH_AXES, Axis, ShardingPolicy

#: Tensor parallelism stays within one host; without ``devices_per_host``, hosts have this many.
DEFAULT_DEVICES_PER_HOST = 8


@dataclass(frozen=True)
class Topology:
    """The mesh an execution runs on, with the policy that shaped it.

    Devices are ordered by (process index, device id) and reshaped to ``(devices / tp, tp)``, so a
    TP group (one mesh row, one replica) never crosses a host while ``batch`` may span hosts.
    """

    mesh: Mesh | AbstractMesh
    policy: ShardingPolicy

    @classmethod
    def new(cls, policy: ShardingPolicy, devices: Sequence[jax.Device] | None = None) -> Topology:
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("Topology needs at least one device; got an empty device list.")
        devices.sort(key=lambda d: (d.process_index, d.id))
        per_process = Counter(d.process_index for d in devices)
        for process, num_local in sorted(per_process.items()):
            check_tp_within_host(policy.tp, num_local, f"local devices of process {process}")
        grid = np.array(devices, dtype=object).reshape(mesh_grid_shape(policy, len(devices)))
        mesh = Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
        return cls(mesh=mesh, policy=policy)

    @classmethod
    def abstract(
        cls, policy: ShardingPolicy, num_devices: int, devices_per_host: int | None = None
    ) -> Topology:
        """The topology of ``num_devices`` on an ``AbstractMesh``: shapes only, no devices."""
        per_host = resolve_devices_per_host(num_devices, devices_per_host)
        check_tp_within_host(policy.tp, per_host, "devices of one host")
        mesh = AbstractMesh(
            mesh_grid_shape(policy, num_devices),
            MESH_AXES,
            axis_types=(AxisType.Auto,) * len(MESH_AXES),
        )
        return cls(mesh=mesh, policy=policy)

    @property
    def device_mesh(self) -> Mesh:
        """The mesh of devices, for what runs or places arrays (an abstract topology has none)."""
        if not isinstance(self.mesh, Mesh):
            raise ValueError(
                f"this topology of {self.mesh.size} devices is abstract (planning, shapes only): "
                "it cannot run a program or place arrays; build it with Topology.new on devices"
            )
        return self.mesh

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def replicas(self) -> int:
        """Data replicas: rows of the mesh, each processing its own examples."""
        return self.mesh.shape[Axis.BATCH]

    @property
    def local_replicas(self) -> int:
        """Replicas whose devices belong to this process."""
        here = jax.process_index()
        return sum(any(d.process_index == here for d in row) for row in self.mesh.devices)

    @property
    def num_processes(self) -> int:
        return len({d.process_index for d in self.mesh.devices.flat})

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh.shape)


def mesh_grid_shape(policy: ShardingPolicy, num_devices: int) -> tuple[int, int]:
    """The mesh's shape ``(batch, shard)``: ``num_devices // tp`` replicas of ``tp`` devices."""
    return (num_devices // policy.tp, policy.tp)


@dataclass(frozen=True)
class UnderMesh:
    """``fn`` (a jitted function) run and lowered with ``mesh`` as the ambient mesh, which
    sharding constraints in traced code resolve against."""

    fn: Any  # a jax.jit-wrapped function
    mesh: Mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args, **kwargs)


def check_tp_within_host(tp: int, num_devices: int, which: str) -> None:
    """A tensor-parallel group must stay within one host: ``tp`` divides its devices."""
    if num_devices % tp:
        divisors = ", ".join(str(k) for k in range(1, num_devices + 1) if num_devices % k == 0)
        raise ValueError(
            f"tp={tp} does not divide the {num_devices} {which}: a tensor-parallel group must "
            f"stay within one host. Choose a tp that divides {num_devices} (e.g. {divisors})."
        )


def resolve_devices_per_host(num_devices: int, devices_per_host: int | None) -> int:
    """Devices of one host of a ``num_devices`` machine (every host has the same number)."""
    if num_devices < 1:
        raise ValueError(f"cannot plan for {num_devices} devices; give a positive device count.")
    if devices_per_host is None:
        return min(num_devices, DEFAULT_DEVICES_PER_HOST)
    if devices_per_host < 1 or num_devices % devices_per_host:
        raise ValueError(
            f"devices per host {devices_per_host} must be positive and divide the {num_devices} "
            "devices (every host has the same number)."
        )
    return devices_per_host
