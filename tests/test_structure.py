"""The house rules that code review would otherwise have to remember: every import (inside
functions too) points one way, no import cycle, every module placed in a layer, file sizes, and the
map of the code in docs/design.md matching the tree."""

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "theseus"
DESIGN = PACKAGE.parent / "docs" / "design.md"
MAX_LINES = 450
MAX_ROOT_MODULES = 6

# Data flows one way: each module may import from its own layer and the layers before it, never
# from a later one. An entry names a module or a package (then every module under it); a module
# belongs to its longest matching entry, and a module that matches none fails the test.
LAYERS = [
    ["config", "accounting", "distributed"],
    ["sharding", "accounting.memory"],
    ["accounting.preflight", "accounting.activations", "checkpoint"],
    ["data"],
    ["tokenization"],
    ["model"],
    ["training"],
    [
        "training.run",
        "inference.generator",
        "inference.sampling",
        "inference.programs",
        "inference.codec",
    ],
    ["posttraining"],
    ["jobs", "plot"],
    ["inference", "hf"],
    ["plan"],
    ["execution"],
    ["cli", "__main__"],
]
# Only these import orbax.checkpoint: one home for reading and writing checkpoints.
ORBAX_HOME = "checkpoint"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")} | {"": PACKAGE / "__init__.py"}


def within(name: str, entry: str) -> bool:
    return name == entry or name.startswith(entry + ".")


def layer_of(name: str) -> int | None:
    matches = [(len(e), i) for i, entries in enumerate(LAYERS) for e in entries if within(name, e)]
    return max(matches)[1] if matches else None


@functools.cache
def nodes_of(path: Path) -> list[ast.AST]:
    """Every node of the syntax tree of ``path`` (parsed once for all the tests)."""
    return list(ast.walk(ast.parse(path.read_text())))


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions and classes."""
    found = set()
    for node in nodes_of(path):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def theseus_imports(path: Path) -> set[str]:
    """The modules of theseus that ``path`` imports (``from theseus.x import y`` names module
    ``x.y`` when that is a module, else ``x``)."""
    names = {i.removeprefix("theseus").lstrip(".") for i in imports_of(path)}
    return {n for n in names if n and n in MODULES} - {module_name(path)}


GRAPH = {name: theseus_imports(path) for name, path in MODULES.items() if name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules (first repeated last), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_counting_imports_inside_functions():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in GRAPH if layer_of(name) is None)
    assert not unplaced, f"add these modules to a layer of LAYERS: {unplaced}"


def test_imports_point_one_way():
    wrong = []
    for here, targets in GRAPH.items():
        for target in targets:
            if within(here, target):  # a module may import its own package's __init__
                continue
            if layer_of(target) > layer_of(here):
                wrong.append(f"{here} imports {target} (a later layer)")
    assert not wrong, wrong


def test_only_the_checkpoint_package_uses_orbax_checkpoint():
    users = sorted(
        name
        for name, path in MODULES.items()
        if any(within(i, "orbax.checkpoint") or i == "orbax" for i in imports_of(path))
        and not within(name, ORBAX_HOME)
    )
    assert not users, f"only theseus.{ORBAX_HOME} may import orbax.checkpoint: {users}"


def test_no_file_under_theseus_exceeds_450_lines():
    long = {
        str(p): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules (at most {MAX_LINES} lines): {long}"


def test_few_modules_at_the_package_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= MAX_ROOT_MODULES, f"move some of {root} into a package"


def test_the_design_layout_names_every_package_and_only_modules_that_exist():
    """docs/design.md's "Layout of the code" names every package (``theseus/x/``), every module
    at the package root and nothing that is gone, so a contributor's map cannot go stale."""
    text = DESIGN.read_text()
    section = text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"theseus/[\w/]+\.py", section))
    packages = {
        str(p.parent.relative_to(PACKAGE.parent)) + "/"
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
    }
    roots = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.glob("*.py")} - {
        "theseus/__init__.py"
    }
    gone = sorted(n for n in named if not (PACKAGE.parent / n).is_file())
    unnamed_packages = sorted(
        p for p in packages if not any(n.startswith(p) for n in named) and p not in section
    )
    assert not gone, f"docs/design.md names modules that do not exist: {gone}"
    assert not unnamed_packages, f"docs/design.md does not name these packages: {unnamed_packages}"
    assert roots <= named, (
        f"docs/design.md does not name these root modules: {sorted(roots - named)}"
    )


FAMILIES = "model.families"
REGISTRY = "jobs"


def test_only_the_registry_imports_a_family_module():
    """A family is one module under theseus/model/families/; the registry (theseus.jobs) alone
    names it (by its dotted name, through importlib), and nothing imports it."""
    family_modules = {n for n in MODULES if within(n, FAMILIES) and n != FAMILIES}
    importers = sorted(
        f"{here} imports {target}"
        for here, targets in GRAPH.items()
        for target in targets & family_modules
    )
    assert not importers, importers
    namers = sorted(
        name
        for name, path in MODULES.items()
        if name not in family_modules | {REGISTRY} and f"theseus.{FAMILIES}." in path.read_text()
    )
    assert not namers, f"only theseus.{REGISTRY} may name a family module: {namers}"
    tests = PACKAGE.parent / "tests"
    users = sorted(p.name for p in tests.glob("*.py") if f"theseus.{FAMILIES}." in p.read_text())
    assert not users, f"tests reach families through theseus.families(): {users}"


def test_a_family_module_is_at_most_400_lines():
    """A family is what makes it different, its Hugging Face mapping included, and no more."""
    family_modules = {n: p for n, p in MODULES.items() if within(n, FAMILIES) and n != FAMILIES}
    long = {n: len(p.read_text().splitlines()) for n, p in family_modules.items()}
    assert family_modules and all(lines <= 400 for lines in long.values()), long


def test_import_theseus_and_the_command_line_start_without_jax():
    """`theseus tokenize` and `--help` start in a fraction of a second: nothing loads JAX,
    orbax or the harness's models until a command needs them."""
    import subprocess
    import sys

    code = (
        "import sys, theseus, theseus.cli.app; "
        "print(sorted({'jax', 'orbax', 'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


TOKENIZER_FOLDER = "tokenization.folder"
FOLDER_FILES = ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def test_one_module_names_the_tokenizer_folder_files():
    """A tokenizer folder's configuration files are string constants of one module (where its
    type, TokenizerFolder, reads them); everything else asks it."""
    namers = sorted(
        name
        for name, path in MODULES.items()
        if any(
            isinstance(node, ast.Constant) and node.value in FOLDER_FILES for node in nodes_of(path)
        )
    )
    assert namers == [TOKENIZER_FOLDER], namers


# Model code reads typed weights by attribute; what it computes never depends on which keys a
# dict holds. A key test is `"k" in d` / `"k" not in d` (a string constant on the left), any
# `.get(key...)` call, `hasattr(...)`, a three-argument `getattr(...)` and `isinstance(x, dict)`.
# Under theseus/model/ one may appear only inside a function (or a function nested in one) with
# a parameter annotated `dict[str, Any]` and named as the JSON dicts of the Hugging Face mapping
# are (`hf`: a config.json; `model`: a model section; `scaling`: its rope scaling), the only dicts
# model code reads: parameters as a dict are typed weights read the wrong way.
CONFIG_DICT = "dict[str, Any]"
CONFIG_NAMES = ("hf", "model", "scaling")


def key_tests(source: str) -> list[str]:
    """``line: code`` of each key test in ``source`` outside a function that takes a
    ``dict[str, Any]``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def reads_config(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(
                    a.annotation and ast.unparse(a.annotation) == CONFIG_DICT
                    for a in args
                    if a.arg in CONFIG_NAMES
                ):
                    return True
        return False

    def is_key_test(node: ast.AST) -> bool:
        if isinstance(node, ast.Compare):
            tests_in = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
            return tests_in and isinstance(node.left, ast.Constant) and type(node.left.value) is str
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        if isinstance(func, ast.Attribute):
            return func.attr == "get" and bool(node.args)  # not a ContextVar's get()
        if not isinstance(func, ast.Name):
            return False
        dict_type = [ast.unparse(a) for a in node.args[1:]] == ["dict"]
        return (
            func.id == "hasattr"
            or (func.id == "getattr" and len(node.args) == 3)
            or (func.id == "isinstance" and dict_type)
        )

    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if is_key_test(node) and not reads_config(node)
    ]


def test_the_key_test_finder_finds_key_tests():
    old_project = (
        "def project(x, proj: dict):\n"
        "    if 'bias' not in proj:\n"
        "        return dense(x, proj['weight'])\n"
        "def head(params: dict, x, paths):\n"
        "    return params.get(paths.head, params[paths.embed])\n"
        "def find(module):\n"
        "    return getattr(module, 'lora_weight', None), hasattr(module, 'kernel')\n"
        "def scaled(layer):\n"
        "    return layer if not isinstance(layer, dict) else {}\n"
    )
    assert len(key_tests(old_project)) == 5, key_tests(old_project)
    config = "def from_hf(hf: dict[str, Any], where: str):\n    return 'x' in hf, hf.get('y')\n"
    assert key_tests(config) == []
    weights = (
        "def zeroed(params: dict[str, Any]):\n"
        "    return {k: zeroed(v) if isinstance(v, dict) else v for k, v in params.items()}\n"
    )
    assert len(key_tests(weights)) == 1, key_tests(weights)


# The model code, and the post-training code that reads a model's weights or log-probabilities
# (preference losses, their rows and trainer, the reference pass; RL's objective, rows, trainer
# and scoring pass; not the readers of users' records and reward modules).
TYPED_CODE = [
    "model/**/*.py",
    "posttraining/preference/*.py",
    *(f"posttraining/rl/{name}.py" for name in ("objective", "rows", "trainer", "scoring")),
]


def test_no_branch_on_the_presence_of_a_dict_key_in_model_code():
    matched = {pattern: sorted(PACKAGE.glob(pattern)) for pattern in TYPED_CODE}
    assert all(matched.values()), matched  # each pattern still names modules
    paths = sorted({path for found in matched.values() for path in found})
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in paths
        if (hits := key_tests(path.read_text()))
    }
    assert not found, f"model code tests dict keys (use typed weights, read by attribute): {found}"


def test_the_skeleton_has_fewer_fields_than_the_eighteen_before_typed_weights():
    """A new feature is a field of the group that needs it (``PerLayer``, ``AttentionOptions``,
    the family's settings), not of ``Skeleton``, which had 18 fields before they were grouped."""
    tree = ast.parse((PACKAGE / "model" / "decoder.py").read_text())
    (skeleton,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Skeleton"]
    fields = [n.target.id for n in skeleton.body if isinstance(n, ast.AnnAssign)]
    assert 5 <= len(fields) < 18, fields


# Typed to the end: what training code passes around (a trainer, its config, a model or its
# section) has its type, never `Any`, and what code reads of one is declared on its type, never
# probed with a fallback (`getattr(model, "dropout", 0.0)`: a renamed field reads the fallback).
TYPED_NAME = re.compile(r"(^|_)(trainer|model|config)(_|$)")  # trainer, base_model, config_class


def is_any(annotation: ast.expr) -> bool:
    """``Any`` itself, or one member of a union (``Any | None``, ``Optional[Any]``)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return is_any(annotation.left) or is_any(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in (
        "Optional",
        "typing.Optional",
    ):
        return is_any(annotation.slice)
    return ast.unparse(annotation) in ("Any", "typing.Any")


def last_name(node: ast.AST) -> str:
    """The name ``x`` or ``a.b.x`` ends with ("" for anything else)."""
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def untyped_names(nodes: list[ast.AST]) -> list[str]:
    """``line: name: annotation`` of each parameter and annotated name or attribute among
    ``nodes`` named like a trainer, model or config whose annotation is ``Any``."""
    found = []
    for node in nodes:
        if isinstance(node, ast.arg):
            name, annotation = node.arg, node.annotation
        elif isinstance(node, ast.AnnAssign):
            name, annotation = last_name(node.target), node.annotation
        else:
            continue
        if annotation is not None and TYPED_NAME.search(name) and is_any(annotation):
            found.append(f"{node.lineno}: {name}: {ast.unparse(annotation)}")
    return found


def probed_reads(nodes: list[ast.AST]) -> list[str]:
    """``line: code`` of each ``getattr(x, name, default)`` among ``nodes`` whose ``x`` (a
    name, or an attribute's last name) is named like a trainer, model or config."""
    found = []
    for node in nodes:
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) == 3
        ):
            continue
        if TYPED_NAME.search(last_name(node.args[0])):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_finders_find_untyped_trainers_and_probed_models():
    old = (
        "def job_of_trainer(trainer: Any) -> str: ...\n"
        "def open_wandb(config: 'Any | None', out_dir: Path): ...\n"
        "class TrainerConfig(Section):\n"
        "    if TYPE_CHECKING:\n"
        "        model: Any = None\n"
        "def kernel(self, base_trainer: Optional[Any], *, model_config: typing.Any): ...\n"
        "def f(self):\n"
        "    self.reference_model: Any = None\n"
        "    return getattr(model, 'dropout', 0.0), getattr(self.config.model, 'x', None)\n"
        "def g(trainer_class):\n"
        "    return getattr(trainer_class, 'family', None)\n"
    )
    nodes = list(ast.walk(ast.parse(old)))
    assert len(untyped_names(nodes)) == 6, untyped_names(nodes)
    assert len(probed_reads(nodes)) == 3, probed_reads(nodes)
    fine = (
        "def f(trainer: BaseTrainer, params: Any, model: nnx.Module, hf: dict[str, Any]):\n"
        "    config: TrainerConfig = trainer.config\n"
        "    return getattr(trainer.layouts, name), getattr(leaf, 'sharding', None)\n"
    )
    nodes = list(ast.walk(ast.parse(fine)))
    assert untyped_names(nodes) == [] and probed_reads(nodes) == []


def test_training_code_types_its_trainers_models_and_configs():
    found = {
        name: hits
        for name, path in sorted(MODULES.items())
        if within(name, "training") and (hits := untyped_names(nodes_of(path)))
    }
    assert not found, f"give these their types (BaseTrainer, TrainerConfig, ...): {found}"


def test_no_code_reads_a_model_or_config_with_a_fallback():
    found = {
        name: hits
        for name, path in sorted(MODULES.items())
        if (hits := probed_reads(nodes_of(path)))
    }
    assert not found, f"declare what is read on the type and read it by attribute: {found}"
