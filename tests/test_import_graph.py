"""No import cycles in any package of the repository.

A cycle makes the import order decide what works (a module half-initialised when another reads it), and
it usually means two layers that should be one above the other know each other. Every `import` counts,
also those inside functions (imported lazily, they still tie the modules together) and those under
`if TYPE_CHECKING:`; the test reads the sources, it imports nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = [ROOT / "lucebox_core", *sorted(p for p in (ROOT / "plugins").glob("*/lucebox_*") if p.is_dir()),
                *sorted(p for p in (ROOT / "backends").glob("*/lucebox_*") if p.is_dir())]


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every package folder above."""
    found = {}
    for package in PACKAGE_DIRS:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository modules `name` imports (anywhere in the file)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                # `from a import b`: the module a.b if there is one, else a (b is a name defined in it).
                child = f"{base}.{alias.name}"
                targets.add(child if child in modules else base)
    edges = set()
    for target in targets:
        # `import a.b.c` runs a, a.b and a.b.c; the deepest repository module is the one that matters here.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _a_cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete loop inside a component, for the failure message."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        following = sorted(graph[path[-1]] & members)
        for other in following:
            if other == start or other not in seen:
                break
        path.append(other)
        if other == start or other in seen:
            return path[path.index(other):] if other != start else path
        seen.add(other)


def test_the_walk_finds_the_packages_and_their_imports():
    modules = _modules()
    assert {"lucebox_core", "lucebox_core.engine", "lucebox_qwen35.model", "lucebox_cuda.backend"} <= set(modules)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "lucebox_core.errors" in graph["lucebox_core.engine"]
    assert "lucebox_core" in graph["lucebox_qwen35.plugin"]  # `from lucebox_core import hookimpl`
    # A lazy import inside a function counts too.
    assert "lucebox_core.plugins" in graph["lucebox_core.loading"]


def test_the_cycle_finder_finds_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _a_cycle_through(["a", "b", "c"], graph) == ["a", "b", "c", "a"]


def test_no_import_cycles_anywhere():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = [" -> ".join(_a_cycle_through(component, graph)) for component in _cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
