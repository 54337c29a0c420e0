"""The shape of course_lib, checked from its source with `ast`: one sub-package per concept, no import cycles,
rank workers imported only by workers, benchmarks, notebooks and tests, and tests for every sub-package.

    .venv/bin/python -m pytest -q tests/test_library_layout.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "course_lib"
TOP_LEVEL_MODULES = {"__init__", "train", "evaluation", "nbtools", "parity"}

# Imports inside a function body, each with the reason it cannot be at the top of its module.
FUNCTION_LEVEL_IMPORTS: dict[tuple[str, str], str] = {
    ("course_lib.pipeline_parallel.workers", "course_lib.pipeline_parallel.torch_pipelining"):
        "torch.distributed.pipelining takes ~1.7 s to import: only the ranks that run torch's schedules pay it",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}
SUB_PACKAGES = sorted(name.split(".")[1] for name in PACKAGES if name.count(".") == 1)
SUBMODULES = {package: {name.rsplit(".", 1)[-1] for name in MODULES if name.rsplit(".", 1)[0] == package}
              for package in PACKAGES}


def lazy_table(package: str) -> dict[str, str]:
    """{name: defining module} from the lazy_exports(__name__, {...}) call of a package's __init__."""
    tree = ast.parse(MODULES[package].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            table = ast.literal_eval(node.args[1])
            return {name: f"{package}.{module}" for module, names in table.items() for name in names}
    return {}


LAZY = {package: lazy_table(package) for package in PACKAGES}


def targets(node: ast.ImportFrom | ast.Import) -> set[str]:
    """The course_lib modules an import statement loads (a lazily re-exported name counts as its module)."""
    found = set()
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    if not node.module or not node.module.startswith("course_lib"):
        return found
    for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        if submodule in MODULES:
            found.add(submodule)
        elif alias.name in LAZY.get(node.module, {}):
            found.add(LAZY[node.module][alias.name])
        else:
            found.add(node.module)
    return found


def import_graph() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """({module: modules it imports}, {(module, imported) done inside a function})."""
    graph, in_functions = {}, set()
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= targets(node) - {name}
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        in_functions |= {(name, target) for target in targets(node)}
        if name in LAZY:
            graph[name] |= set(LAZY[name].values()) - {name}  # a package may load any module it re-exports
    return graph, in_functions


GRAPH, IN_FUNCTIONS = import_graph()


def is_worker(module: str) -> bool:
    return "workers" in module.rsplit(".", 1)[-1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_checks():
    """The walk must find real edges, or every assertion below passes on an empty graph."""
    assert "course_lib.core.model" in GRAPH["course_lib.parity"]
    assert "course_lib.sharding.zero" in GRAPH["course_lib.sharding"]  # apply_zero builds on both optimizers
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_no_import_runs_back_up_between_packages():
    """Sub-packages stand on floors: none imports one that imports it back, however indirectly."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for importer, imports in GRAPH.items():  # course_lib itself only re-exports lazily (and gives lazy_exports)
        packages.setdefault(package(importer), set()).update(
            package(m) for m in imports if package(m) not in (package(importer), "course_lib"))
    assert cycles(packages) == []


def test_the_learners_library_holds_no_grading_or_bench_code():
    """Grading and benchmarks live in course_tools, which imports course_lib; course_lib never imports it."""
    assert not any(name.split(".")[1:2] in (["grading"], ["bench"]) for name in MODULES)
    importers = sorted(name for name, path in MODULES.items() if "course_tools" in path.read_text()
                       and re.search(r"^\s*(from|import) course_tools", path.read_text(), re.M))
    assert importers == []
    assert (REPO_ROOT / "course_tools" / "grading" / "sandbox.py").is_file()
    assert (REPO_ROOT / "course_tools" / "bench" / "report.py").is_file()


def test_only_workers_and_package_faces_import_workers():
    offenders = sorted((importer, imported) for importer, imports in GRAPH.items() for imported in imports
                       if is_worker(imported) and not is_worker(importer) and importer not in PACKAGES)
    assert offenders == []


def test_function_level_imports_of_course_lib_are_listed_with_their_reason():
    unexplained = sorted(IN_FUNCTIONS - set(FUNCTION_LEVEL_IMPORTS))
    assert unexplained == [], "import these at the top of the module, or say in FUNCTION_LEVEL_IMPORTS why not"
    assert set(FUNCTION_LEVEL_IMPORTS) <= IN_FUNCTIONS, "FUNCTION_LEVEL_IMPORTS lists an import that is gone"


def test_top_level_holds_few_modules_and_no_session_or_worker_names():
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL_MODULES
    assert len(SUB_PACKAGES) >= 10
    for name in MODULES:
        leaf = name.rsplit(".", 1)[-1]
        assert not re.search(r"session_?[a-e]\b|session_[a-e]_", leaf), f"{name}: a module is named for a concept"
    assert not any(is_worker(name) for name in MODULES if name.count(".") == 1)


def test_every_package_reexports_only_what_its_modules_define():
    for package, table in LAZY.items():
        for name, module in table.items():
            tree = ast.parse(MODULES[module].read_text())
            defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            defined |= {name.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                        for name in ast.walk(target) if isinstance(name, ast.Name)}  # HIDDEN, ROWS = 6, 3 too
            assert name in defined, f"{package} re-exports {name} from {module}, which does not define it"
            assert name not in SUBMODULES.get(package, ()), \
                f"{package} re-exports {name}, the name of one of its modules: the module would hide it"


@pytest.mark.parametrize("sub_package", SUB_PACKAGES)
def test_every_sub_package_has_tests(sub_package):
    folder = REPO_ROOT / "tests" / sub_package
    files = sorted(folder.glob("test_*.py"))
    assert files, f"tests/{sub_package}/ has no test_*.py"
    assert any(f"course_lib.{sub_package}" in path.read_text() for path in files), \
        f"no test in tests/{sub_package}/ imports course_lib.{sub_package}"


def notebook_imports(path: Path) -> list[tuple[int, str]]:
    """(cell index, module) of every course_lib import in a notebook's code cells."""
    import json

    found = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(line for line in "".join(cell["source"]).splitlines(keepends=True)
                         if not line.lstrip().startswith(("%", "!")))  # IPython magics are not Python
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
                found.append((index, node.module))
            elif isinstance(node, ast.Import):
                found += [(index, alias.name) for alias in node.names if alias.name.startswith("course_lib")]
    return found


ROOTS = {"course_lib"} | {f"course_lib.{name}" for name in SUB_PACKAGES + sorted(TOP_LEVEL_MODULES - {"__init__"})}
NOTEBOOKS = sorted((REPO_ROOT / "solutions").glob("*/*.ipynb"))


def test_notebook_imports_are_recognised():
    assert notebook_imports(NOTEBOOKS[0]), "no course_lib import found in the first notebook: the walk is broken"
    assert "course_lib.data_parallel" in ROOTS and "course_lib.train" in ROOTS
    assert "course_lib.data_parallel.ddp" not in ROOTS


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_notebook_imports_course_lib_from_package_roots(notebook):
    """`from course_lib.data_parallel import BucketedDataParallel`, never a module path inside a package."""
    deep = [(cell, module) for cell, module in notebook_imports(notebook) if module not in ROOTS]
    assert deep == [], f"{notebook.name} imports from modules inside packages (cell, module): {deep}"


def optimizer_steps(tree: ast.AST) -> list[int]:
    """Lines that take an optimizer step: `<x>.step()` (not a scheduler's), `<scaler>.step(optimizer)`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step":
            receiver = ast.unparse(node.func.value).lower()
            if "sched" in receiver:
                continue
            if (not node.args and not node.keywords) or "scaler" in receiver:
                lines.append(node.lineno)
    return lines


# The only places besides core/steps.py that step an optimizer, each with the reason it cannot call train_step.
OWN_STEPS = {
    "course_lib.debugging.train_job":
        "the debugging labs' job is a user's standalone script: its bugs live in its own loop, which the learner reads",
    "course_lib.integrations.accelerate_train": "Accelerate owns the step (accelerator.backward, its prepared optimizer)",
    "course_lib.integrations.deepspeed_train": "DeepSpeed's engine owns the step (engine.backward, engine.step)",
}


def test_the_walk_finds_optimizer_steps():
    found = optimizer_steps(ast.parse("opt.step()\nscaler.step(opt)\nscheduler.step()\nrunner.step(tokens)\n"))
    assert found == [1, 2]


def test_one_optimizer_step_in_the_library():
    """Every loop that trains calls core.steps.train_step; no module takes an optimizer step of its own: not in
    course_lib, not in the benchmarks and grading of course_tools."""
    tools = {module_name(p): p for p in sorted((REPO_ROOT / "course_tools").rglob("*.py"))}
    stepping = {name for name, path in {**MODULES, **tools}.items() if optimizer_steps(ast.parse(path.read_text()))}
    assert "course_lib.core.steps" in stepping
    assert stepping - {"course_lib.core.steps"} == set(OWN_STEPS), \
        "call course_lib.core.steps.train_step (its forward_backward / after_backward / before_step hooks carry " \
        "what a worker records) instead of stepping the optimizer yourself"
