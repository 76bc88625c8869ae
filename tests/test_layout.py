"""The layout's rules, read from the source: one import name (`clusterserve`, over the
repository's top-level folders), no import cycles among the project's modules, `kernels` free of
HTTP and of the models, `models` free of FastAPI and of the service, and models' sub-packages
layered (runtime, networks, planning, batch)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = "clusterserve"
PACKAGES = (NAME, "kernels", "models", "engine", "service", "bench")  # folders; all but the first install as NAME.<folder>


def module_name(path: Path) -> str:
    """The installed name of a source file: kernels/spec.py -> clusterserve.kernels.spec."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == NAME else [NAME, *parts])


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports at run time (not those under `if TYPE_CHECKING:`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = {id(node) for stmt in ast.walk(tree) if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
               for node in ast.walk(stmt)}  # fmt: skip
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module; `from pkg import name`, the package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("kernels", ("models", "engine", "service", "fastapi", "starlette", "prometheus_client")),
        ("models", ("engine", "service", "fastapi", "starlette", "prometheus_client")),
        ("engine", ("service", "fastapi", "starlette", "prometheus_client")),
    ],
)
def test_layers_import_downward_only(package, forbidden):
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                layer = name.removeprefix(f"{NAME}.").split(".")[0]
                assert layer not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


# models' sub-packages, each importing only those listed after it: the runtime runs batches
# (models.batch) through the networks and reads the plan; planning reads the checkpoint's data
# and no model; a batch's layout knows no network.
MODELS_ORDER = ("runtime", "networks", "planning", "batch")


def models_subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "models" and parts[2] in MODELS_ORDER else None


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one of models' sub-packages to one listed before it, or beside it."""
    found = []
    for module, targets in graph.items():
        source = models_subpackage(module)
        for target in targets:
            into = models_subpackage(target)
            if source and into and into != source and MODELS_ORDER.index(into) <= MODELS_ORDER.index(source):
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_upward_arrows_are_found():
    graph = {"clusterserve.models.batch.packing": {"clusterserve.models.runtime.runner"},
             "clusterserve.models.runtime.runner": {"clusterserve.models.batch.packing"}}
    assert upward_arrows(graph) == ["clusterserve.models.batch.packing -> clusterserve.models.runtime.runner"]


def test_models_sub_packages_import_downward_only():
    assert upward_arrows(import_graph()) == []


def python_files() -> list[Path]:
    return [path for folder in (*PACKAGES, "tests") for path in (ROOT / folder).rglob("*.py")] + [ROOT / "setup.py"]


def test_the_project_is_imported_by_its_one_name_only():
    """A bare `import kernels` would take Hugging Face's distribution (installed) or this
    checkout's folder (run from the root), never both the same way: the code and the tests say
    `clusterserve.kernels`."""
    bare = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bare += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in PACKAGES[1:]]
    assert not bare, f"imports of the project by a top-level name other than {NAME}: {bare}"


def test_the_longest_first_order_names_test_files_that_exist():
    from collection_order import LONGEST_FIRST

    assert len(LONGEST_FIRST) > 1
    missing = [path for path in LONGEST_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"tests/collection_order.py LONGEST_FIRST names files that do not exist: {missing}"
