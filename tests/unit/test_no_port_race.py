"""No test picks a free port and closes it for a server to bind later (decision 0322).

Between the close and the server's bind, anything on the machine can take the port: a
test beside it, a second suite run at the same time. That is how
``test_the_readiness_alert_fires_when_the_database_stops`` failed with "cannot bind
127.0.0.1:60471 (address already in use)" while it passed alone. Servers bind port 0 and
report the port they got (``--ready-file``; ``tests/ports.py`` says how), and a port where
nothing may listen is held bound (``tests.ports.refused_port``).

This scans every Python file under ``tests/`` and ``bench/`` for the pattern: a socket
bound to port 0 whose port is read and which is then closed (a ``with`` block that returns
the port, or whose port is used after the block; an explicit ``close()``), and for
helpers named like one (``free_port``, ``unused_port``, ...).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "bench")
#: Files allowed the pattern, each with its reason (none: PostgreSQL, which must be told
#: its port, gets one held for it until it listens, ``tests/pg.py``).
ALLOWED: dict[str, str] = {}
HELPER_NAME = re.compile(r"(free|unused|pick|spare|open|available)_(loopback_)?port", re.I)


def _is_port_zero_bind(node: ast.AST) -> str | None:
    """The socket's name when ``node`` is ``NAME.bind((host, 0))``."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "bind"
        and isinstance(node.func.value, ast.Name)
        and node.args
        and isinstance(node.args[0], ast.Tuple)
        and len(node.args[0].elts) >= 2
    ):
        return None
    port = node.args[0].elts[1]
    if isinstance(port, ast.Constant) and port.value == 0:
        return node.func.value.id
    return None


def _calls_on(tree: ast.AST, name: str, method: str) -> bool:
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == name
        for node in ast.walk(tree)
    )


def _assigned_from_getsockname(block: list[ast.stmt], sock: str) -> set[str]:
    names: set[str] = set()
    for statement in block:
        for node in ast.walk(statement):
            if (
                isinstance(node, ast.Assign | ast.AnnAssign)
                and node.value is not None
                and _calls_on(node.value, sock, "getsockname")
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names.add(leaf.id)
    return names


def _uses(statements: list[ast.stmt], names: set[str]) -> bool:
    return any(
        isinstance(node, ast.Name) and node.id in names
        for statement in statements
        for node in ast.walk(statement)
    )


def _with_socket(node: ast.With | ast.AsyncWith) -> str | None:
    for item in node.items:
        if isinstance(item.optional_vars, ast.Name):
            return item.optional_vars.id
    return None


def pick_and_close(source: str) -> list[tuple[int, str]]:
    """Each ``(line, what)`` of ``source`` that picks a port and closes its socket."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and HELPER_NAME.search(
            node.name
        ):
            found.append((node.lineno, f"a port-picking helper {node.name}()"))
        body: list[ast.stmt] | None = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for index, statement in enumerate(body):
            if isinstance(statement, ast.With | ast.AsyncWith):
                sock = _with_socket(statement)
                if sock is None or not any(
                    _is_port_zero_bind(n) == sock for s in statement.body for n in ast.walk(s)
                ):
                    continue
                held = any(
                    isinstance(n, ast.Yield | ast.YieldFrom | ast.Await)
                    for s in statement.body
                    for n in ast.walk(s)
                ) or _calls_on(statement, sock, "listen")
                ports = _assigned_from_getsockname(statement.body, sock)
                returns = any(
                    isinstance(n, ast.Return) and n.value is not None
                    for s in statement.body
                    for n in ast.walk(s)
                )
                used_after = bool(ports) and _uses(body[index + 1 :], ports)
                if not held and (returns or used_after):
                    found.append(
                        (statement.lineno, "a socket bound to port 0, closed, its port used")
                    )
            if isinstance(statement, ast.With | ast.AsyncWith):
                continue
            for sub in ast.walk(statement):
                sock = _is_port_zero_bind(sub)
                rest = body[index:]
                if (
                    sock is not None
                    and any(_calls_on(s, sock, "close") for s in rest)
                    and any(_calls_on(s, sock, "getsockname") for s in rest)
                    and not any(_calls_on(s, sock, "listen") for s in body)
                ):
                    found.append((sub.lineno, "a socket bound to port 0, its port read, closed"))
    return sorted(set(found))


def _sources() -> list[Path]:
    return sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize(
    "source",
    [
        "import socket\ndef free_port():\n    return 1\n",
        "import socket\ndef port():\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        return s.getsockname()[1]\n",
        "import socket\ndef f():\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        port = s.getsockname()[1]\n"
        "    start(port)\n",
        "import socket\ndef f():\n    s = socket.socket()\n    s.bind(('127.0.0.1', 0))\n"
        "    port = s.getsockname()[1]\n    s.close()\n    start(port)\n",
    ],
)
def test_the_check_finds_the_pattern(source: str) -> None:
    assert pick_and_close(source)


@pytest.mark.parametrize(
    "source",
    [
        # Held for the block: nobody else can bind it (tests.ports.refused_port).
        "import socket\ndef held():\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        yield s.getsockname()[1]\n",
        # Held while a server is asked to bind it (a port clash on purpose).
        "import socket\ndef f():\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        s.listen()\n"
        "        run(s.getsockname()[1])\n",
        "import socket\ndef f():\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        port = s.getsockname()[1]\n"
        "        run(port)\n",
    ],
)
def test_the_check_lets_a_held_socket_be(source: str) -> None:
    assert not pick_and_close(source)


def test_no_test_or_benchmark_picks_a_port_and_closes_it() -> None:
    offenders = []
    for path in _sources():
        relative = path.relative_to(ROOT).as_posix()
        if relative in ALLOWED:
            continue
        for line, what in pick_and_close(path.read_text(encoding="utf-8")):
            offenders.append(f"{relative}:{line}: {what}")
    assert not offenders, (
        "a port picked and closed can be taken before the server binds it: start the "
        "server on port 0 and read the port it got (--ready-file, tests/ports.py), or "
        "hold the socket (tests.ports.refused_port):\n" + "\n".join(offenders)
    )
