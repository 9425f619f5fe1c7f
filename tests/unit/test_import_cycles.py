"""No import circle among the packages: every `import` in their modules, those inside functions included
(a function-level import hides a circle from Python, not from a reader), read with ast, nothing imported.
Imports under `if TYPE_CHECKING:` are left out: they never run. A parent package is not an edge of its
submodules (Python imports it first anyway), so a package's `__init__` may hold what its modules share
only if it imports none of them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "router", "rollout", "trainer", "evaluator")


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages."""
    found = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module, nested ones included, less those under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules (of `mods`) it imports, resolving `from pkg import submodule` to the submodule."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = []
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        graph[name] = {t for t in map(known, targets) if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_packages_imports_itself_through_others():
    graph = import_graph(modules(ROOT, PACKAGES))
    circles = {" <-> ".join(c): {m: sorted(graph[m] & set(c)) for m in c} for c in cycles(graph)}
    assert not circles, f"import circles (module -> the circle's modules it imports): {circles}"


def test_the_check_sees_a_circle_closed_by_an_import_inside_a_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (tmp_path / "pkg" / "d.py").write_text("from . import c\n")
    assert cycles(import_graph(modules(tmp_path, ("pkg",)))) == [["pkg.a", "pkg.b"]]
