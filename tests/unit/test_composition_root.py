"""The composition root builds in a plain function and the app owns its start and stop
(decision 0333): ``build_planner`` wires and binds, ``PlannerApp.start``/``stop`` sit side
by side, and no code sets another object's private fields."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from service.server import root

REPO = Path(__file__).resolve().parents[2]


def _is_self(value: ast.expr) -> bool:
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


def private_fields_set_from_outside(folder: str) -> list[str]:
    """Every ``x._name = ...`` (or ``+=``, annotated) under ``folder`` where ``x`` is
    not ``self`` or ``cls``, as ``path:line``."""
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for part in ast.walk(target):
                    if (
                        isinstance(part, ast.Attribute)
                        and part.attr.startswith("_")
                        and not part.attr.startswith("__")
                        and not (
                            isinstance(part.value, ast.Name) and part.value.id in ("self", "cls")
                        )
                    ):
                        found.append(f"{path.relative_to(REPO).as_posix()}:{node.lineno}")
    return found


def test_no_code_of_the_planner_sets_another_objects_private_fields() -> None:
    assert private_fields_set_from_outside("service") == []


def test_the_app_starts_and_stops_side_by_side() -> None:
    methods = [
        name
        for name, value in vars(root.PlannerApp).items()
        if inspect.isfunction(value) and not name.startswith("_")
    ]
    assert methods.index("stop") == methods.index("start") + 1, methods


def test_the_build_is_a_plain_function_that_starts_nothing() -> None:
    build = inspect.getsource(root.build_planner)
    for starting in (".start(", "create_task(", "start_metrics_server("):
        assert starting not in build, starting
    start = inspect.getsource(root.start_planner)
    assert "build_planner(" in start and "app.start()" in start
