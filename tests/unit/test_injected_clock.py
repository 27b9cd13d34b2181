"""The core reads time only through its ``Clock`` port (``service/core/ports/clock.py``), so
a test's clock governs every deadline, lease and duration the core computes.

A direct read of the machine's clocks anywhere in ``service/core`` fails here: an import of
the ``time`` module, ``datetime.now``/``utcnow``/``today``, ``date.today`` or an event
loop's ``time()``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import service.core

CORE = Path(service.core.__file__).parent
#: What is named as the place time comes from (the port declares it, nothing reads it).
CLOCK_MODULE = CORE / "ports" / "clock.py"
WALL_CLOCK_READS = {
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("datetime", "today"),
    ("date", "today"),
}


def direct_time_reads(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every direct clock read in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name == "time"]
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            found.append((node.lineno, "from time import ..."))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, attr = node.func.value, node.func.attr
            if isinstance(owner, ast.Name) and (owner.id, attr) in WALL_CLOCK_READS:
                found.append((node.lineno, f"{owner.id}.{attr}()"))
            elif attr == "time" and not node.args and not node.keywords:
                found.append((node.lineno, ".time()"))
    return found


def test_the_core_reads_time_only_through_the_clock_port() -> None:
    found = [
        f"{path.relative_to(CORE.parent.parent)}:{line}: {what}"
        for path in sorted(CORE.rglob("*.py"))
        if path != CLOCK_MODULE
        for line, what in direct_time_reads(path.read_text())
    ]
    assert found == [], "read time through the injected Clock instead:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_direct_read() -> None:
    source = (
        "import time\nfrom time import monotonic\nimport asyncio\n"
        "from datetime import date, datetime\n"
        "a = time.monotonic()\nb = datetime.now()\nc = date.today()\n"
        "d = asyncio.get_running_loop().time()\n"
    )
    assert sorted(line for line, _ in direct_time_reads(source)) == [1, 2, 6, 7, 8]
