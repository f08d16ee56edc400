"""The device mesh: ``(batch, shard)`` of shape ``(num_devices // tp, tp)``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from theseus.base.axis import MESH_AXES, Axis, ShardingPolicy


@dataclass(frozen=True)
class Topology:
    """The mesh an execution runs on, with the policy that shaped it.

    Devices are ordered by (process index, device id) and reshaped to ``(devices / tp, tp)``, so a
    TP group (one mesh row, one replica) never crosses a host while ``batch`` may span hosts.
    """

    mesh: Mesh
    policy: ShardingPolicy

    @classmethod
    def new(cls, policy: ShardingPolicy, devices: Sequence[jax.Device] | None = None) -> Topology:
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("Topology needs at least one device; got an empty device list.")
        devices.sort(key=lambda d: (d.process_index, d.id))
        per_process = Counter(d.process_index for d in devices)
        tp = policy.tp
        for process, num_local in sorted(per_process.items()):
            if num_local % tp:
                raise ValueError(
                    f"tp={tp} does not divide the {num_local} local devices of process {process}: "
                    "a tensor-parallel group must stay within one host. Choose a tp that divides "
                    f"{num_local} (e.g. {_divisors(num_local)})."
                )
        grid = np.array(devices, dtype=object).reshape(len(devices) // tp, tp)
        mesh = Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
        return cls(mesh=mesh, policy=policy)

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

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

    def global_batch_size(self, per_device_batch_size: int, accumulation_steps: int = 1) -> int:
        """Examples per step: per replica × replicas × accumulation (TP devices share examples)."""
        return per_device_batch_size * self.replicas * accumulation_steps


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)
