"""The planner's production code does not depend on the devstack, and the devstack uses
only the planner's public entry points; no module of the service outgrows one concern
(issue 10; docs/decisions/0160-devstack-split.md).

Read from the source with ``ast``, so an import hidden in a function counts too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: What the devstack may import of the planner: its composition root and its settings.
PLANNER_PUBLIC = {"service.main", "service.config"}


@dataclass(frozen=True)
class Import:
    path: str
    line: int
    module: str
    #: The innermost function the import is in; "" at module level.
    function: str


def imports_under(folder: str) -> list[Import]:
    found: list[Import] = []
    for path in sorted((REPO / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        relative = path.relative_to(REPO).as_posix()

        def visit(node: ast.AST, function: str, relative: str = relative) -> None:
            for child in ast.iter_child_nodes(node):
                inner = function
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    inner = child.name
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        found.append(Import(relative, child.lineno, alias.name, inner))
                elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                    found.append(Import(relative, child.lineno, child.module, inner))
                visit(child, inner)

        visit(tree, "")
    return found


def _top(module: str) -> str:
    return module.partition(".")[0]


def test_service_imports_devstack_only_in_the_clis_one_lazy_import() -> None:
    of_devstack = [i for i in imports_under("service") if _top(i.module) == "devstack"]
    assert [(i.path, i.function, i.module) for i in of_devstack] == [
        ("service/cli.py", "_dev", "devstack.dev")
    ], of_devstack


def test_devstack_uses_only_the_planners_public_entry_points() -> None:
    of_planner = [i for i in imports_under("devstack") if _top(i.module) == "service"]
    internal = [i for i in of_planner if i.module not in PLANNER_PUBLIC]
    assert not internal, internal
    # The entry points are still used (dev starts the planner), so the check has teeth.
    assert {i.module for i in of_planner} >= PLANNER_PUBLIC


def test_the_walk_sees_imports_inside_functions() -> None:
    # The check above would pass vacuously if function bodies were skipped.
    lazy = [i for i in imports_under("service") if i.path == "service/cli.py" and i.function]
    assert any(i.module == "service.main" for i in lazy)


def test_the_core_imports_no_transport_storage_or_telemetry_library() -> None:
    # STYLE rule 1: the core reaches the world only through its ports; tracing included
    # (service/core/tracing.py is the port, service/adapters/tracing.py the adapter).
    forbidden = {"grpc", "google", "sqlalchemy", "psycopg", "opentelemetry", "prometheus_client"}
    found = [i for i in imports_under("service/core") if _top(i.module) in forbidden]
    assert not found, found
    assert any(i.module == "service.core.tracing" for i in imports_under("service/core"))


#: The largest module ``service/`` may hold, in lines (issue 10, Done-when 3): past it a
#: module owns more than one thing and is split, as ``service/core/turn/`` was.
MAX_MODULE_LINES = 600


def test_no_module_of_the_service_is_over_600_lines() -> None:
    sizes = {
        path.relative_to(REPO).as_posix(): len(path.read_text().splitlines())
        for path in (REPO / "service").rglob("*.py")
    }
    too_long = {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not too_long, too_long
    assert max(sizes.values()) > MAX_MODULE_LINES // 2  # the walk found the modules
