"""The library and the roles never import the tooling around runs (common/runs/): the command line,
launcher and dashboard run the roles, not the other way round. Read from the source (every import
statement, at any depth), so a function-level import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "router", "rollout", "trainer", "evaluator")
RUNS = "common.runs"


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names (for `from a import b`, both a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_role_or_library_module_imports_common_runs():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("common", "runs"):
                continue
            bad = sorted(n for n in imported_modules(path) if n == RUNS or n.startswith(RUNS + "."))
            offenders += [f"{rel}: {name}" for name in bad]
    assert not offenders, "imports of the run tooling outside common/runs/:\n" + "\n".join(offenders)
