"""The programs' packages import the way docs/architecture.md draws them, and no module
of them imports itself around a circle (docs/decisions/0200-one-folder-per-program.md).

Read from the source with ``ast``, so an import hidden in a function counts too; only
imports under ``if TYPE_CHECKING:`` are left out (they never run).

The layers, top to bottom:

- ``service.cli`` (the command), ``service.server`` (the composition root and the process);
- ``service.transport`` (gRPC in) and ``service.adapters`` (the world behind the ports),
  which never import each other;
- ``service.core`` (the planner itself: no gRPC, protobuf, SQL or telemetry library);
- ``service.config``; then ``ballet_common``, which imports none of the programs.

``ballet_chat`` (the terminal client) imports only ``ballet_common`` and the generated
contracts; the devstack uses only the planner's public entry points; the planner knows
neither (they add their subcommands through entry points).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The shipped packages, each a folder of the repository.
PACKAGES = ("service", "ballet_chat", "ballet_common", "devstack")
#: What the devstack may import of the planner: its composition root, its settings and
#: its logging (``dev`` runs the planner in-process).
PLANNER_PUBLIC = {"service.server.root", "service.config", "service.server.logs"}


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written (``from a.b import c``: ``a.b.c`` when
    ``c`` is a module, else ``a.b``)."""

    path: str
    line: int
    source: str
    module: str
    #: The innermost function the import is in; "" at module level.
    function: str


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(source: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    relative = path.relative_to(REPO).as_posix()
    found: list[Import] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, function)
                continue
            inner = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = child.name
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(relative, child.lineno, source, alias.name, inner))
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for alias in child.names:
                    target = f"{child.module}.{alias.name}"
                    module = target if target in MODULES else child.module
                    found.append(Import(relative, child.lineno, source, module, inner))
            visit(child, inner)

    visit(tree, "")
    return found


IMPORTS = [i for name, path in MODULES.items() for i in _imports_of(name, path)]


def imports_from(prefix: str) -> list[Import]:
    """Imports made by the modules of package ``prefix``."""
    return [i for i in IMPORTS if _within(i.source, prefix)]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _to(imports: Iterable[Import], *prefixes: str) -> list[tuple[str, int, str]]:
    return [
        (i.path, i.line, i.module)
        for i in imports
        if any(_within(i.module, prefix) for prefix in prefixes)
    ]


def test_the_walk_sees_every_package_and_imports_inside_functions() -> None:
    # Every rule below would pass vacuously if the walk missed modules or function bodies.
    assert {name.partition(".")[0] for name in MODULES} == set(PACKAGES)
    lazy = [i for i in imports_from("service.cli") if i.function]
    assert any(i.module == "service.server.root" for i in lazy)


def test_no_import_circle_anywhere_in_the_shipped_packages() -> None:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for i in IMPORTS:
        # Importing a.b.c runs the packages a and a.b first: count them as imported too,
        # but for the importer's own parent packages, which are always run before it.
        parts = i.module.split(".")
        for end in range(1, len(parts) + 1):
            target = ".".join(parts[:end])
            own_parent = i.source.startswith(target + ".") and end < len(parts)
            if target in MODULES and target != i.source and not own_parent:
                graph[i.source].add(target)
    circles = [sorted(group) for group in _strongly_connected(graph) if len(group) > 1]
    assert not circles, circles


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively (the graph has a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def test_ballet_common_imports_none_of_the_programs() -> None:
    found = _to(imports_from("ballet_common"), "service", "ballet_chat", "devstack")
    assert not found, found


def test_the_chat_client_speaks_only_the_api() -> None:
    # The terminal client is a client like the realtime gateway: the contracts and the
    # shared plumbing, nothing of the server or the devstack.
    found = _to(imports_from("ballet_chat"), "service", "devstack")
    assert not found, found


def test_the_planner_knows_neither_the_chat_client_nor_the_devstack() -> None:
    found = _to(imports_from("service"), "ballet_chat", "devstack")
    assert not found, found


def test_devstack_uses_only_the_planners_public_entry_points() -> None:
    of_planner = [i for i in imports_from("devstack") if _within(i.module, "service")]
    internal = [i for i in of_planner if i.module not in PLANNER_PUBLIC]
    assert not internal, internal
    # The entry points are still used (dev starts the planner), so the check has teeth.
    assert {i.module for i in of_planner} >= {"service.server.root", "service.config"}


def test_the_core_imports_no_transport_storage_or_telemetry_library() -> None:
    # The core reaches the world only through its ports; tracing included
    # (service/core/tracing.py is the port, service/adapters/tracing.py the adapter).
    forbidden = {"grpc", "google", "sqlalchemy", "psycopg", "opentelemetry", "prometheus_client"}
    found = [i for i in imports_from("service.core") if i.module.partition(".")[0] in forbidden]
    assert not found, found
    assert any(i.module == "service.core.tracing" for i in imports_from("service.core"))


def test_the_core_imports_no_outer_layer() -> None:
    outer = ("service.transport", "service.adapters", "service.server", "service.config",
             "service.cli", "ballet")
    found = _to(imports_from("service.core"), *outer)
    assert not found, found


def test_transport_and_adapters_do_not_import_each_other_or_the_process() -> None:
    found = _to(imports_from("service.transport"), "service.adapters", "service.server")
    found += _to(imports_from("service.adapters"), "service.transport", "service.server")
    assert not found, found


def test_configuration_imports_only_common_code() -> None:
    found = _to(imports_from("service.config"), "service.core", "service.transport",
                "service.adapters", "service.server", "service.cli")
    assert not found, found
