"""What a run gets on this machine, for ``theseus doctor``: versions, backend and devices, how the
processes are found, the attention kernel training gets and whether it runs, the peak FLOP/s
behind MFU, the XLA flags, and warnings a user can act on.

:func:`system_facts` gathers what is read from the system (installed packages, device files,
environment variables); :func:`environment_report` turns those facts and what JAX reports into a
report, so a test can give it any system.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from theseus.distributed.join import Membership
from theseus.model.attention import (
    AttentionMask,
    Kernel,
    attention,
    fused_kernel,
    kernel_refusal,
)
from theseus.training.flops import device_peak

#: The jax version the tests run (constraints.txt pins it; tests/test_doctor.py keeps them equal).
TESTED_JAX = "0.10.2"
# Distributions that bring JAX's backends: jaxlib and the accelerator plugins.
BACKEND_PACKAGES = ("jaxlib", "jax-cuda", "jax-rocm", "libtpu")
# Environment variables that pass flags to XLA and its TPU runtime.
FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# What shows NVIDIA GPUs and TPUs to the system, whatever JAX sees.
GPU_MARKERS = ("/dev/nvidia[0-9]*",)
TPU_MARKERS = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


@dataclass(frozen=True)
class SystemFacts:
    """What the system shows: installed JAX packages (name → version), the accelerators its
    device files (or nvidia-smi) show, and the flag variables set."""

    packages: dict[str, str]
    visible_gpus: tuple[str, ...]
    visible_tpus: tuple[str, ...]
    flags: dict[str, str]


def system_facts() -> SystemFacts:
    """The facts of this machine."""
    packages = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "jax" or name.startswith(BACKEND_PACKAGES):
            packages[name] = dist.version
    gpus = [path for pattern in GPU_MARKERS for path in sorted(glob.glob(pattern))]
    smi = shutil.which("nvidia-smi")
    if not gpus and smi:
        gpus = [smi]
    tpus = [path for pattern in TPU_MARKERS for path in sorted(glob.glob(pattern))]
    flags = {name: os.environ[name] for name in FLAG_VARIABLES if os.environ.get(name)}
    return SystemFacts(dict(sorted(packages.items())), tuple(gpus), tuple(tpus), flags)


@dataclass(frozen=True)
class DeviceGroup:
    """Devices of one kind: how many, and each one's memory when the backend reports it."""

    kind: str
    platform: str
    count: int
    memory_bytes: int | None


@dataclass(frozen=True)
class Processes:
    """This process's place in the job and how it was found."""

    count: int
    index: int
    found_by: str


@dataclass(frozen=True)
class Attention:
    """The kernel training's causal attention gets on ``backend`` (``model.attention=auto``):
    ``fallback`` says why not the backend's fused kernel when it is refused; ``ran`` whether a
    tiny compiled call of the kernel ran here, ``error`` why not (one line)."""

    backend: str
    kernel: str  # "blockwise", "cudnn" or "splash"
    fallback: str | None
    ran: bool
    error: str | None

    def describe(self) -> str:
        chosen = self.kernel + (f" ({self.fallback})" if self.fallback else "")
        ran = "ran" if self.ran else f"did not run ({self.error})"
        return f"attention on {self.backend} (model.attention=auto): {chosen}; {ran}"


@dataclass(frozen=True)
class PeakFlops:
    """The peak FLOP/s per device that MFU divides by, per compute dtype (None: no MFU)."""

    device_kind: str
    flops_per_s: dict[str, float | None]
    source: str


@dataclass(frozen=True)
class EnvironmentReport:
    """What ``theseus doctor`` shows (``--json``: these fields)."""

    versions: dict[str, str]
    tested_jax: str
    backend: str
    devices: tuple[DeviceGroup, ...]
    processes: Processes
    attention: Attention
    peak: PeakFlops
    xla_flags: dict[str, str]
    warnings: tuple[str, ...]

    json_properties: ClassVar[dict[str, str]] = {"healthy": "healthy"}

    @property
    def healthy(self) -> bool:
        return not self.warnings

    def describe(self) -> str:
        devices = "; ".join(
            f"{group.count} × {group.kind} ({group.platform}"
            + (f", {group.memory_bytes / 2**30:.1f} GiB each)" if group.memory_bytes else ")")
            for group in self.devices
        )
        peaks = ", ".join(
            f"{dtype} {flops / 1e12:g} TFLOP/s"
            for dtype, flops in self.peak.flops_per_s.items()
            if flops
        )
        lines = [
            "versions: "
            + ", ".join(f"{name} {version}" for name, version in self.versions.items())
            + f" (tested: jax {self.tested_jax})",
            f"backend: {self.backend}; devices: {devices}",
            f"processes: {self.processes.index} of {self.processes.count} ({self.processes.found_by})",
            self.attention.describe(),
            f"peak FLOP/s for MFU ({self.peak.device_kind}): {peaks or 'none'} ({self.peak.source})",
            "XLA flags: " + ("; ".join(f"{k}={v}" for k, v in self.xla_flags.items()) or "none"),
        ]
        lines += [f"warning: {warning}" for warning in self.warnings] or ["healthy: no warnings"]
        return "\n".join(lines)


def environment_report(
    system: SystemFacts, membership: Membership, *, simulated_cpu_devices: int | None
) -> EnvironmentReport:
    """The report of this process's JAX on ``system``; ``simulated_cpu_devices`` is the count
    ``--cpu-devices`` (or XLA's host device count flag) asked for, if any."""
    devices = jax.devices()
    backend = jax.default_backend()
    groups: dict[tuple[str, str], list[Any]] = {}
    for device in devices:
        groups.setdefault((device.device_kind, device.platform), []).append(device)
    versions = {"jax": jax.__version__, **system.packages}
    peaks = {dtype: device_peak(devices[0], dtype) for dtype in ("bfloat16", "float32")}
    attention = attention_report(backend)
    return EnvironmentReport(
        versions=versions,
        tested_jax=TESTED_JAX,
        backend=backend,
        devices=tuple(
            DeviceGroup(kind, platform, len(group), _memory_bytes(group[0]))
            for (kind, platform), group in groups.items()
        ),
        # The job this process would join (doctor itself starts no distributed runtime).
        processes=Processes(membership.num_processes, membership.process_id, found_by(membership)),
        attention=attention,
        peak=PeakFlops(
            devices[0].device_kind,
            {dtype: peak.flops_per_s for dtype, peak in peaks.items()},
            peaks["bfloat16"].source,
        ),
        xla_flags=system.flags,
        warnings=tuple(warnings(system, backend, versions, simulated_cpu_devices, attention)),
    )


def _memory_bytes(device: Any) -> int | None:
    stats = device.memory_stats()  # None where the backend reports none (CPU)
    return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


def found_by(membership: Membership) -> str:
    """How the processes were found, in words."""
    if membership.kind == "explicit":
        return f"the coordinator flags: --coordinator {membership.coordinator}"
    if membership.kind is not None:
        return f"{membership.kind} detected by JAX"
    return "single process: no cluster detected"


def attention_report(backend: str) -> Attention:
    """The kernel training's causal attention gets on ``backend`` (the backend's fused kernel
    unless it refuses the call, else blockwise), and whether a tiny compiled call of it (bfloat16,
    a shape every kernel takes) runs on this process's default device. ``backend`` is JAX's,
    or another one's name to see what that backend would choose from this process."""
    q = jnp.ones((1, 128, 4, 64), jnp.bfloat16)  # (batch, seq, heads, head_dim)
    mask = AttentionMask.causal(q.shape[1])
    kernel: Kernel = "blockwise"
    fallback: str | None = None
    if (fused := fused_kernel(backend)) is not None:
        fallback = kernel_refusal(fused, q, mask, None, ())
        kernel = "blockwise" if fallback else fused
    try:
        causal = jax.jit(lambda q: attention(q, q, q, mask, kernel=kernel))
        jax.block_until_ready(causal(q))
    except Exception as error:  # noqa: BLE001 — any failure means: it does not run here
        return Attention(backend, kernel, fallback, ran=False, error=_first_line(error))
    return Attention(backend, kernel, fallback, ran=True, error=None)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def warnings(
    system: SystemFacts,
    backend: str,
    versions: dict[str, str],
    simulated_cpu_devices: int | None,
    attention: Attention,
) -> list[str]:
    """What a user can act on: accelerators JAX does not use, simulated devices, an untested jax,
    an attention kernel that does not run."""
    found = []
    plugins = [name for name in system.packages if name.startswith(("jax-cuda", "jax-rocm"))]
    # Simulated CPU devices were asked for: the CPU is the user's choice, not a failed plugin.
    unused_accelerators = backend == "cpu" and simulated_cpu_devices is None
    if system.visible_gpus and unused_accelerators:
        why = (
            f"the installed plugin(s) {plugins} did not start (see JAX's log above)"
            if plugins
            else "no CUDA plugin is installed"
        )
        found.append(
            f"the system shows NVIDIA GPUs ({', '.join(system.visible_gpus)}) but JAX runs on "
            f"the CPU: {why}; install theseus with `pip install -c constraints.txt -e '.[cuda12]'` "
            "(or '.[cuda13]' for CUDA 13 drivers) and check again"
        )
    if system.visible_tpus and unused_accelerators:
        found.append(
            f"the system shows TPU devices ({', '.join(system.visible_tpus)}) but JAX runs on the "
            "CPU: libtpu is missing or did not start; install theseus with "
            "`pip install -c constraints.txt -e '.[tpu]'` and check again"
        )
    if simulated_cpu_devices is not None and backend == "cpu":
        found.append(
            f"the {simulated_cpu_devices} CPU devices are simulated (--cpu-devices or XLA's "
            "--xla_force_host_platform_device_count): they share this machine's cores, so speed "
            "and MFU say nothing about real devices"
        )
    if not attention.ran:
        other = "blockwise" if attention.kernel != "blockwise" else "xla"
        found.append(
            f"training's attention ({attention.kernel}, chosen by model.attention=auto) did not "
            f"run here: {attention.error}; train with model.attention={other}"
        )
    if versions["jax"] != TESTED_JAX:
        found.append(
            f"jax {versions['jax']} is not the tested version {TESTED_JAX}; install the pinned "
            "versions with `pip install -c constraints.txt -e .`"
        )
    return found


def simulated_cpu_devices(cpu_devices: int | None, xla_flags: str) -> int | None:
    """The CPU device count a user asked to simulate: ``--cpu-devices`` or XLA's flag."""
    if cpu_devices is not None:
        return cpu_devices
    for flag in xla_flags.split():
        name, _, value = flag.partition("=")
        if name == "--xla_force_host_platform_device_count" and value.isdigit() and int(value) > 1:
            return int(value)
    return None
