"""One name, one meaning (decision 0334): no class or type alias name is defined in two
modules of ``service/``. A re-export (``Acting = backend_types.Acting``) is the same
meaning and allowed; two definitions of one name (the stored ``TurnState`` and the loop's
state were one such pair) are not."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service"


def _is_type_name(name: str) -> bool:
    return name[:1].isupper() and not name.isupper()


def _reexports(value: ast.expr, name: str) -> bool:
    """``X = module.X`` or ``X = X``: the same thing under its own name."""
    if isinstance(value, ast.Name):
        return value.id == name
    return isinstance(value, ast.Attribute) and value.attr == name


def definitions(source: str) -> set[str]:
    """The class and type alias names a module defines (module level and nested)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            for target in targets:
                if not isinstance(target, ast.Name) or not _is_type_name(target.id):
                    continue
                if value is not None and _reexports(value, target.id):
                    continue
                names.add(target.id)
    return names


def defined_twice(root: Path = SERVICE) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for name in definitions(path.read_text()):
            where[name].append(path.relative_to(root).as_posix())
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_no_name_is_defined_twice_across_the_service() -> None:
    assert defined_twice() == {}


def test_a_second_definition_is_found_and_a_reexport_is_not(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("class TurnState:\n    pass\n")
    (tmp_path / "state.py").write_text("class TurnState:\n    pass\n")
    (tmp_path / "ports.py").write_text("import model\nTurnState = model.TurnState\n")
    assert defined_twice(tmp_path) == {"TurnState": ["model.py", "state.py"]}
