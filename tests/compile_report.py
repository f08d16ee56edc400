"""``THESEUS_COMPILE_REPORT=FILE pytest ...``: per test, the seconds JAX spent tracing, lowering and compiling
(its monitoring events) and the number of programs compiled, beside the wall time of the test and
its CPU time (user + sys of the worker and of the subprocesses it waited for).

Every worker appends one JSON line per test to FILE; the controller prints the tests that took the
most CPU time at the end (the suite's budget counts CPU as well as wall time). Compilation dominates
this suite, so this says where its time goes; pair it with ``--durations``.
"""

import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import jax.monitoring
import pytest

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s",
}

_current: dict[str, float] = defaultdict(float)


def _cpu_s() -> float:
    """User + sys seconds of this process and of its children that ended and were waited for."""
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _listen(event: str, duration: float, **_: object) -> None:
    name = EVENTS.get(event)
    if name is not None:
        _current[name] += duration
        if name == "compile_s":
            _current["num_compiled"] += 1


def pytest_configure(config):
    path = os.environ.get("THESEUS_COMPILE_REPORT")
    if not path:
        return
    config._compile_report = Path(path).resolve()
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers) starts it
        config._compile_report.write_text("")
    jax.monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = getattr(item.config, "_compile_report", None)
    if path is None:
        yield
        return
    _current.clear()
    start, cpu_start = time.perf_counter(), _cpu_s()
    yield
    row = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "wall_s": round(time.perf_counter() - start, 2),
        "cpu_s": round(_cpu_s() - cpu_start, 2),
        **{key: round(value, 2) for key, value in sorted(_current.items())},
    }
    with path.open("a") as report:
        report.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    path = getattr(config, "_compile_report", None)
    if path is None or hasattr(config, "workerinput") or not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    total = defaultdict(float)
    for row in rows:
        for key in ("wall_s", "cpu_s", "trace_s", "lower_s", "compile_s", "num_compiled"):
            total[key] += row.get(key, 0)
    terminalreporter.section(f"JAX compile report ({path})")
    terminalreporter.write_line(
        f"{len(rows)} tests: wall {total['wall_s']:.0f} s, cpu {total['cpu_s']:.0f} s, trace {total['trace_s']:.0f} s, "
        f"lower {total['lower_s']:.0f} s, compile {total['compile_s']:.0f} s, "
        f"{int(total['num_compiled'])} programs compiled"
    )
    rows.sort(key=lambda r: r.get("cpu_s", 0), reverse=True)
    for row in rows[:25]:
        terminalreporter.write_line(
            f"{row.get('cpu_s', 0):7.1f} s cpu {row.get('compile_s', 0):7.1f} s compile "
            f"{row.get('trace_s', 0):6.1f} s trace {int(row.get('num_compiled', 0)):4d} programs "
            f"{row['wall_s']:7.1f} s wall  {row['test']}"
        )
