"""The devstack never reaches into the planner's internals (issue 14): what both need
(token verification and minting, the dev secret, audience names, private files) lives in
``ballet_common``. The planner's public entry points (``service.main``, ``service.config``)
are the only ``service`` modules a devstack module may import: the one that runs
``ballet-planner dev`` starts the planner through them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"service.main", "service.config"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_devstack_imports_nothing_internal_from_the_planner() -> None:
    offending = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "devstack").rglob("*.py"))
        for name in imported_modules(path)
        if (name == "service" or name.startswith("service.")) and name not in PUBLIC
    }
    assert offending == set()


def test_ballet_common_imports_neither_side() -> None:
    for path in sorted((ROOT / "ballet_common").rglob("*.py")):
        for name in imported_modules(path):
            assert name.split(".")[0] not in {"service", "devstack"}, (path, name)
