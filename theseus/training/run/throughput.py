"""Step time, tokens/s and MFU of each recorded step, without any extra host sync.

The loop reads step ``n``'s metrics after dispatching step ``n + 1`` (one step late); that read
returns when step ``n`` has finished on the device. :class:`StepClock` takes a host timestamp right
after each such read, so the difference between two consecutive timestamps is the time between two
step completions: the device's step time while the device is the bottleneck (the host is then
waiting in that read, or in the dispatch: XLA:CPU starts a program with collectives only after the
previous one has finished), and the true time per step when the host is. A step that has already
finished when it is handed over (XLA:CPU runs small programs inline, at dispatch) is read and timed
at once, not one step late. This adds nothing to the loop: no ``block_until_ready``, no extra transfer. JAX offers no completion callback that would
timestamp on the device side without a host thread waiting. The first step is timed from the
start of the loop. Validation and checkpoint saves run between steps with the clock paused
(``MetricsWriter.paused``): the step before them is read first, and the clock restarts after them,
so every row, the last one included, measures its own step and nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from theseus.training.flops import FlopsCount, Peak, device_peak


@dataclass(frozen=True)
class Speedometer:
    """What turns a step time into tokens/s and MFU for one run."""

    tokens_per_step: int
    flops: FlopsCount
    peak: Peak
    num_devices: int

    def rates(self, step_time_s: float, trained_tokens: int) -> dict[str, float]:
        """``step_time_s``, ``tokens_per_s`` (every position of the step's rows),
        ``trained_tokens_per_s`` (the targets that trained: all of them but for masked data) and,
        when the device's peak is known, ``mfu``."""
        tokens_per_s = self.tokens_per_step / step_time_s
        rates = {
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s,
            "trained_tokens_per_s": trained_tokens / step_time_s,
        }
        if self.peak.flops_per_s is not None:
            achieved = self.flops.per_token * tokens_per_s
            rates["mfu"] = achieved / (self.peak.flops_per_s * self.num_devices)
        return rates

    def facts(self) -> dict[str, Any]:
        """The run.json entries: FLOPs per token and their method, device kind and peak (or why
        there is no MFU)."""
        facts: dict[str, Any] = {
            "flops_per_token": self.flops.per_token,
            "flops_counted_by": self.flops.method,
            "device_kind": self.peak.device_kind,
            "peak_flops_per_s_per_device": self.peak.flops_per_s,
        }
        key = "peak_flops_source" if self.peak.flops_per_s is not None else "mfu_absent_because"
        facts[key] = self.peak.source
        return facts


def speedometer(trainer, flops: FlopsCount) -> Speedometer:
    """The speedometer of ``trainer``'s runs on its mesh's devices."""
    plan = trainer.batch_plan
    device = trainer.mesh.devices.flat[0]
    peak = device_peak(device, trainer.config.training.dtype, trainer.config.logging.peak_tflops)
    return Speedometer(plan.tokens_per_step, flops, peak, trainer.topology.num_devices)


class StepClock:
    """Host timestamps of step completions, taken as each step's metrics are read."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def restart(self) -> None:
        """Start the next lap now (after work between steps that no step's time should hold)."""
        self.last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or since the clock started)."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds
