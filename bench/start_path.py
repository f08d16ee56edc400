"""How a run starts, module by module: `theseus train` traced from the command to the state the
loop starts with (the run's first log line), for a fresh run, --resume, --init-from, and a LoRA
run on an --init-from base, fresh and resumed (its base's frozen parameters read from the base).

For each it prints the modules of the start path (the command, execution, jobs, training/run
and checkpoint modules, and the modules they call), how many times control enters each from
another module, and the calls back "up": into a module that is still on the call stack (a
callback), which is what makes a path read bottom-up. Figures: docs/design.md, "How a run
starts". Run it with PYTHONPATH naming another checkout to trace that one.

    python bench/start_path.py [--verbose]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import theseus

#: The modules whose code decides how a run starts; the modules they call are listed as leaves.
PATH = (
    "theseus.cli.",
    "theseus.execution",
    "theseus.jobs",
    "theseus.training.run.",
    "theseus.checkpoint.",
)
ROOT = str(Path(theseus.__file__).parent)  # the theseus that runs (PYTHONPATH decides)
TINY = (
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=4",
    "model.block_size=16",
    "training.batch_size=4",
    "training.per_device_batch_size=4",
    "training.validation_batches=1",
    "logging.progress_bar=false",
)


def module_of(frame: FrameType | None) -> str | None:
    """The theseus module ``frame`` runs in (None outside theseus)."""
    filename = frame.f_code.co_filename if frame is not None else ""
    if not filename.startswith(ROOT):
        return None
    relative = Path(filename[len(ROOT) - len("theseus") :]).with_suffix("")
    return ".".join(relative.parts).removesuffix(".__init__")


def on_path(module: str) -> bool:
    return module.startswith(PATH)


@dataclass
class Trace:
    """Cross-module calls of the start path, in order."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (caller, callee, function)
    callbacks: list[tuple[str, str, str]] = field(default_factory=list)
    active: bool = False
    done: bool = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.done:
            return
        callee = module_of(frame)
        if callee is None:
            return
        name = frame.f_code.co_name
        if callee == "theseus.cli.training" and name == "train":
            self.active = True
        if not self.active:
            return
        if callee == "theseus.distributed.join" and name == "describe_processes":
            self.done = True  # the run's first line: the loop has its starting state
            sys.setprofile(None)
            return
        stack, names = [], [name]  # theseus frames from the caller up to the command
        caller_frame = frame.f_back
        while caller_frame is not None:
            if (module := module_of(caller_frame)) is not None:
                stack.append(module)
                names.append(caller_frame.f_code.co_name)
                if (module, caller_frame.f_code.co_name) == ("theseus.cli.training", "train"):
                    break  # the decorators around the command are not the path
            caller_frame = caller_frame.f_back
        if "<module>" in names:  # importing a module is not a step of the path
            return
        caller = stack[0] if stack else "-"
        if caller == callee or not (on_path(callee) or on_path(caller)):
            return
        self.calls.append((caller, callee, name))
        if callee in stack:
            self.callbacks.append((caller, callee, name))


def traced(args: list[str]) -> Trace:
    from typer.testing import CliRunner

    from theseus.cli.app import app

    trace = Trace()
    sys.setprofile(trace)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        sys.setprofile(None)
    if result.exit_code != 0:
        raise SystemExit(f"theseus {' '.join(args)} failed:\n{result.output}")
    return trace


def report(name: str, trace: Trace, verbose: bool) -> None:
    entries = Counter(callee for _, callee, _ in trace.calls)
    path_modules = sorted(m for m in entries if on_path(m))
    leaves = sorted(m for m in entries if not on_path(m))
    print(f"\n{name}: {len(path_modules)} path modules, {len(leaves)} leaf modules")
    for module in path_modules:
        print(f"  {entries[module]:3d} entries  {module}")
    print(f"  leaves: {', '.join(leaves)}")
    print(f"  calls back up ({len(trace.callbacks)}):")
    for caller, callee, function in trace.callbacks:
        print(f"    {caller} -> {callee}.{function}")
    if verbose:
        for caller, callee, function in trace.calls:
            print(f"    {caller} -> {callee}.{function}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print every cross-module call")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    lora = ("finetune.lora_rank=4", "finetune.lora_alpha=8")
    with tempfile.TemporaryDirectory() as folder:
        base, init, tuned = (str(Path(folder) / n) for n in ("base", "init", "lora"))
        runs = {
            "fresh": ["train", "--out", base, *TINY, "training.steps=2"],
            "--resume": ["train", "--out", base, "--resume", *TINY, "training.steps=3"],
            "--init-from": ["train", "--out", init, "--init-from", base, *TINY, "training.steps=1"],
            "LoRA --init-from": [
                "train", "--out", tuned, "--init-from", base, *TINY, *lora, "training.steps=1",
            ],
            "LoRA --resume": ["train", "--out", tuned, "--resume", *TINY, *lora, "training.steps=2"],
        }  # fmt: skip
        for name, command in runs.items():
            report(name, traced(command), args.verbose)


if __name__ == "__main__":
    main()
