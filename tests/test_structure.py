"""The house rules that code review would otherwise have to remember: file sizes and the one-way
import graph (config → axis/topology/layout → trainer → loop/checkpoint → execution → CLI)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "theseus"
MAX_LINES = 450

# Each module may import from its own layer and the layers before it, never from a later one.
# A module not listed here is not checked (add new modules to their layer).
LAYERS = [
    ["config", "base.records", "collectives", "distributed", "supervise", "launch"],
    ["training.stops", "training.preemption", "training.resume", "training.nonfinite"],
    ["base.axis", "base.topology", "base.layout", "base.layer_scan", "base.memory"],
    ["base.preflight", "fingerprints"],
    ["data", "data.tokens", "data.sampler", "data.bpe"],
    ["model", "model.layers", "model.gpt", "model.decode", "model.gpt_decode"],
    ["training.base", "training.gpt", "training.gathering", "training.progress"],
    ["training.summary", "training.checkpointing", "training.metrics", "checkpoint", "jobs"],
    ["training.loop", "plot"],
    [
        "inference",
        "inference.codec",
        "inference.generate",
        "inference.sampling",
        "inference.weights",
    ],
    ["plan", "plan.policies", "plan.results", "plan.render", "plan.build", "plan.budget"],
    ["execution"],
    ["cli", "plan_command", "text_commands", "launch_command"],
]
# Same layer, but the first must not import the second.
FORBIDDEN = [("training.loop", "plan"), ("checkpoint", "training.base")]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def theseus_imports(path: Path) -> set[str]:
    """Modules of theseus that ``path`` imports at module level (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("theseus"):
            found.add(node.module.removeprefix("theseus").lstrip("."))
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("theseus.") for a in node.names if a.name.startswith("theseus.")
            }
    return found - {""}


def test_no_file_under_theseus_exceeds_450_lines():
    long = {
        str(p): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules (at most {MAX_LINES} lines): {long}"


def test_imports_point_one_way():
    layer = {name: index for index, names in enumerate(LAYERS) for name in names}
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        if here not in layer:
            continue
        for target in theseus_imports(path):
            if target in layer and layer[target] > layer[here]:
                wrong.append(f"{here} imports {target} (a later layer)")
            wrong += [
                f"{here} imports {target}"
                for source, banned in FORBIDDEN
                if here == source and (target == banned or target.startswith(banned + "."))
            ]
    assert not wrong, wrong
