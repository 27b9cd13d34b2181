"""A sampling profile of the planner process while it runs one-round turns.

py-spy attaches to the running planner by pid (``py-spy record --pid --gil``: only
samples of the thread holding the GIL, i.e. Python code running on the CPU; waiting in
epoll and grpc's own threads drop out) and writes collapsed stacks
(``frame;frame;... count``). SQLAlchemy runs each statement in a greenlet whose stack
does not show the planner frames that started it, so part of its time is charged to no
planner function. ``analyse`` reads them three ways:

- ``components``: each sample charged to the library its innermost frame is in
  (SQLAlchemy, psycopg, grpc, protobuf, jsonschema, asyncio, the planner itself, ...);
- ``planner_functions``: each sample charged to the innermost *planner* frame
  (``service/...``) on its stack, i.e. the planner function whose own work or direct
  library calls cost it, with that function's component breakdown;
- ``inclusive``: the share of samples whose stack passes through a planner function.

py-spy is not a declared dependency (it is a profiler binary from PyPI); without it the
profile is skipped and the report says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]+)(?::\d+)?\)$")

#: Components by a path fragment of the frame's file, first match wins.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("sqlalchemy/", "SQLAlchemy"),
    ("psycopg", "psycopg"),
    ("grpc/", "grpc"),
    ("grpc_status/", "grpc"),
    ("google/protobuf", "protobuf"),
    ("google/rpc", "protobuf"),
    ("jsonschema", "jsonschema"),
    ("referencing/", "jsonschema"),
    ("jwt/", "PyJWT"),
    ("cryptography/", "PyJWT"),
    ("prometheus_client/", "prometheus"),
    ("logging/", "logging"),
    ("asyncio/", "asyncio"),
    ("json/", "json"),
    ("uuid.py", "uuid"),
    ("service/", "planner"),
    ("ballet/", "generated protos"),
)


def component(path: str) -> str:
    """The component a frame's file belongs to (``other`` when none)."""
    for fragment, name in COMPONENTS:
        if fragment in path:
            return name
    return "other"


def find_py_spy() -> str | None:
    """The py-spy executable: beside this interpreter (a venv), or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def start_recording(
    pid: int, duration_s: int, output: Path, rate: int = 250
) -> subprocess.Popen[bytes]:
    """Start py-spy on ``pid`` for ``duration_s`` seconds, writing collapsed stacks to
    ``output``; the caller waits for the returned process."""
    executable = find_py_spy()
    if executable is None:
        raise FileNotFoundError("py-spy is not installed")
    return subprocess.Popen(
        [
            executable,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(duration_s),
            "--rate",
            str(rate),
            "--gil",
            "--format",
            "raw",
            "--output",
            str(output),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@dataclass
class Profile:
    """What ``analyse`` found; shares are fractions of all samples."""

    samples: int = 0
    components: dict[str, float] = field(default_factory=dict)
    planner_functions: list[dict[str, object]] = field(default_factory=list)
    inclusive: list[tuple[str, float]] = field(default_factory=list)


def _frames(stack: str) -> list[tuple[str, str]]:
    frames = []
    for raw in stack.split(";"):
        match = _FRAME.match(raw.strip())
        if match:
            frames.append((match.group("function"), match.group("file")))
        else:
            frames.append((raw.strip(), ""))
    return frames


def analyse(collapsed: str, *, top: int = 12) -> Profile:
    """Read py-spy's raw output (see the module docstring)."""
    total = 0
    by_component: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    function_parts: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = _frames(stack)
        if not frames:
            continue
        total += count
        leaf_component = component(frames[-1][1])
        by_component[leaf_component] += count
        owner = "(outside planner code: event loop, grpc, ...)"
        for function, path in reversed(frames):
            if "service/" in path:
                owner = f"{path.split('service/', 1)[1]}:{function}"
                break
        by_function[owner] += count
        function_parts[owner][leaf_component] += count
        seen = set()
        for function, path in frames:
            if "service/" in path:
                name = f"{path.split('service/', 1)[1]}:{function}"
                if name not in seen:
                    seen.add(name)
                    inclusive[name] += count
    profile = Profile(samples=total)
    if not total:
        return profile
    profile.components = {name: n / total for name, n in by_component.most_common()}
    profile.planner_functions = [
        {
            "function": name,
            "share": n / total,
            "components": {c: k / total for c, k in function_parts[name].most_common(4)},
        }
        for name, n in by_function.most_common(top)
    ]
    profile.inclusive = [(name, n / total) for name, n in inclusive.most_common(top)]
    return profile
