"""No import cycle in ``src/pagedllm``: the layers form a drawing with arrows one way.

The graph is read from the source with ``ast``, not by importing: an import inside a
function counts (a lazy import hides a cycle from the interpreter, not from a reader), one
under ``if TYPE_CHECKING:`` does not (it never runs; annotations may name each other).
A package's own ``__init__`` importing its submodules is the usual shape and no cycle:
importing ``a.b`` is an edge to ``a.b`` only, not to ``a``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and every node below it, except those under ``if TYPE_CHECKING:``."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for branch in child.orelse:
                yield from _runtime_nodes(branch)
        else:
            yield from _runtime_nodes(child)


def _imported_modules(node: ast.AST, package: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` an import statement loads: ``from a import b`` loads
    module ``a.b`` when there is one, else ``a`` (b is one of its names)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    found = {f"{base}.{alias.name}" for alias in node.names}
    return {name if name in modules else base for name in found} & modules


def import_graph(root: Path) -> Graph:
    """Each module of the tree under ``root`` -> the modules of the tree it imports."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: Graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {
            target
            for node in _runtime_nodes(tree)
            for target in _imported_modules(node, package, modules)
            if target != name
        }
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None: a depth-first search that meets a
    module still on its stack."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        on_stack = {start: 0}
        while stack:
            node, edges = stack[-1]
            target = next(edges, None)
            if target is None:
                stack.pop()
                del on_stack[node]
                done.add(node)
            elif target in on_stack:
                return [n for n, _ in stack[on_stack[target] :]] + [target]
            elif target not in done:
                on_stack[target] = len(stack)
                stack.append((target, iter(sorted(graph[target]))))
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(SRC))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_lazy_import_back_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import run\n")
    (package / "a.py").write_text("from pkg import b\n\ndef run():\n    return b\n")
    (package / "b.py").write_text("def back():\n    from pkg.a import run\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    graph = import_graph(tmp_path)
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.c"] == set()
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_a_tree_without_cycles_passes(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("import os\n")
    assert find_cycle(import_graph(tmp_path)) is None
