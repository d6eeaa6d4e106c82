"""The import structure: no circles among the project's modules, and the configuration on the ground floor.

Every import counts: at the top, inside functions, under `TYPE_CHECKING`, and the technique catalog's import of the
built-in technique modules by name, so moving an import into a function or behind `TYPE_CHECKING` does not hide a
circle. A package's `__init__` importing its own modules is not one (that is how a package presents them): importing
`tasks.engines.contract` counts as an edge to that module, not to `tasks.engines`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tasks", "flows", "serving", "infra")
# all tasks/config.py may import of the project (config_serving: its serving sections, on the same floor)
GROUND_FLOOR = {"tasks.schema", "tasks.errors", "tasks.config_serving"}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name `path` imports anywhere in its body (functions, TYPE_CHECKING blocks included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module → the project modules it imports (and, for the catalogs, the built-in modules they import by name)."""
    from serving.api.catalog import BUILT_IN as BUILT_IN_APIS
    from tasks.engines import BUILT_IN as BUILT_IN_ENGINES
    from tasks.techniques.catalog import BUILT_IN
    from tasks.techniques.quantize.step import BUILT_IN as BUILT_IN_METHODS
    from tasks.weights.catalog import BUILT_IN as BUILT_IN_FORMATS

    modules = project_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        targets = {resolve(name) for name in imported_names(path, module)} - {None, module}
        graph[module] = targets
    graph["tasks.techniques.catalog"] |= set(BUILT_IN)
    graph["tasks.engines"] |= {f"tasks.engines.{name}.runtime" for name in BUILT_IN_ENGINES}
    graph["tasks.weights.catalog"] |= {f"tasks.weights.{name}" for name in BUILT_IN_FORMATS}
    graph["serving.api.catalog"] |= {f"serving.api.{name}" for name in BUILT_IN_APIS}
    graph["tasks.techniques.quantize.step"] |= {
        f"tasks.techniques.quantize.{name}" for name in BUILT_IN_METHODS
    }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_project_has_no_import_circles():
    assert circles(import_graph()) == []


def test_the_configuration_is_the_ground_floor():
    graph = import_graph()
    assert graph["tasks.config"] <= GROUND_FLOOR | {"tasks"}, graph["tasks.config"] - GROUND_FLOOR
    # nothing the configuration is built from reaches the technique registry (reading settings loads no technique)
    reached, todo = set(), ["tasks.config"]
    while todo:
        for other in graph[todo.pop()] - reached:
            reached.add(other)
            todo.append(other)
    assert "tasks.techniques.registry" not in reached


# The modules that call MLflow: runs (tracking), the Model Registry, and the pyfunc entry point MLflow itself loads.
MLFLOW_MODULES = {"tasks.report.tracking", "tasks.decide.model_registry", "tasks.decide.pyfunc_model"}


def test_only_the_tracking_and_registry_modules_import_mlflow():
    importers = {
        module
        for module, path in project_modules().items()
        if any(name == "mlflow" or name.startswith("mlflow.") for name in imported_names(path, module))
    }
    assert importers == MLFLOW_MODULES, importers ^ MLFLOW_MODULES


def test_imports_inside_functions_and_under_type_checking_count(tmp_path):
    """The walker sees what a circle could hide behind."""
    path = tmp_path / "module.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tasks.params import Config\n"
        "def later():\n    from ..engines import manifest\n    import tasks.errors\n"
    )
    names = imported_names(path, "tasks.measure.module")
    assert {"tasks.params", "tasks.params.Config", "tasks.engines.manifest", "tasks.errors"} <= names
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
