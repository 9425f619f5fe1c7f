"""Who may import whom. The library and the roles never import the tooling around runs (common/runs/): the
command line, launcher and dashboard run the roles, not the other way round. The library imports no role,
and inside the trainer the model knows nothing of ranks or training, and the core nothing of the drivers
above it. Read from the source (every import statement, at any depth), so a function-level import counts."""

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


# Module prefix -> the prefixes it must not import. trainer.tinykit (the demo's tiny seeded checkpoint) is a
# tool every role may build its model with, so it is not the trainer's layer.
BELOW = {
    "common": ("router", "rollout", "trainer", "evaluator"),
    "router": ("rollout", "trainer", "evaluator"),
    "rollout": ("trainer", "evaluator"),
    "evaluator": ("trainer", "router"),
    "trainer.model": ("trainer.core", "trainer.rl", "trainer.ep", "trainer.ranks", "trainer.optim", "trainer.pretrain"),
    "trainer.experts": ("trainer.core", "trainer.rl", "trainer.ep", "trainer.ranks", "trainer.pretrain"),
    "trainer.ep": ("trainer.core", "trainer.rl", "trainer.pretrain", "trainer.role", "trainer.commands"),
    "trainer.core": ("trainer.rl", "trainer.pretrain", "trainer.role", "trainer.commands"),
}
ANYONE_MAY_IMPORT = ("trainer.tinykit",)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_each_layer_imports_nothing_above_it():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            forbidden = [f for prefix, above in BELOW.items() if _under(module, prefix) for f in above]
            for name in sorted(imported_modules(path)):
                if any(_under(name, f) for f in forbidden) and not any(_under(name, a) for a in ANYONE_MAY_IMPORT):
                    offenders.append(f"{module}: {name}")
    assert not offenders, "imports against the layers:\n" + "\n".join(offenders)
