"""Child processes of the benchmark and what they cost: CPU seconds and memory.

The benchmark runs as one process tree (docs/decisions/0090-bench-process-layout.md):
the driver (this process: load client and orchestration), the planner (``ballet-planner
serve``), the dependency stack (``python -m bench.stack``: devstack backends and LLM
gateway), the bare echo server (``python -m bench.bare``) and PostgreSQL.

CPU time comes from ``/proc/<pid>/stat`` (``utime`` + ``stime``, in clock ticks, so the
resolution is 1/``SC_CLK_TCK`` s, 10 ms here; every figure built from it sums hundreds
of turns). PostgreSQL is the postmaster plus every process whose parent it is, plus
``cutime``/``cstime`` of the postmaster, which hold the time of backends that already
exited. The driver reads its own time with ``resource.getrusage``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: Clock ticks per second of /proc/<pid>/stat times.
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
#: The repository root, the working directory of every child (``python -m`` finds
#: ``service``, ``devstack``, ``bench`` and the generated code from there).
REPO_ROOT = Path(__file__).resolve().parents[1]
#: A child that is not ready in this many seconds is broken, not slow.
READY_TIMEOUT_S = 60.0


def _stat_fields(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) is in parentheses and may hold spaces; fields after it
    # start with the state (field 3), so field N is at index N - 3.
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of ``pid`` (all its threads); with ``children``, plus
    those of its waited-for children. Raises ``OSError`` when the process is gone."""
    fields = _stat_fields(pid)
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``/proc/<pid>/statm``)."""
    resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return resident * PAGE_BYTES


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 when unknown)."""
    try:
        return int(_stat_fields(pid)[1])
    except (OSError, ValueError, IndexError):
        return 0


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_of(int(entry)) == pid:
            found.append(int(entry))
    return found


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent busy so far (``/proc/stat``: all but
    idle and iowait), to see how much other work ran beside the benchmark."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(value) for value in fields]
    # user nice system idle iowait irq softirq steal (guest time is inside user).
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]
    return busy / CLK_TCK


def self_cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class PostgresProcesses:
    """The processes of a local PostgreSQL cluster, found from its data directory."""

    data_dir: Path

    def postmaster(self) -> int:
        """The postmaster's pid (first line of ``postmaster.pid``)."""
        return int((self.data_dir / "postmaster.pid").read_text().split()[0])

    def cpu_seconds(self) -> float:
        """CPU seconds of the postmaster, its live children and its exited children."""
        root = self.postmaster()
        total = cpu_seconds(root, children=True)
        for child in children_of(root):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += cpu_seconds(child)
        return total


class Child:
    """A child process that prints one JSON line when it is ready.

    ``argv`` runs with the repository root as working directory; ``stderr`` goes to
    ``log_path``. ``ready`` is the JSON object of the first stdout line (e.g. the
    address the child bound).
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        wait_line: bool = True,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.process = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if wait_line else subprocess.DEVNULL,
            stderr=self._log,
        )
        self.ready: dict[str, object] = {}
        if wait_line:
            self.ready = self._read_ready()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read_ready(self) -> dict[str, object]:
        assert self.process.stdout is not None
        # readline blocks; a child that dies closes stdout, so it returns b"" then.
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=READY_TIMEOUT_S)
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode} before it was ready; "
                f"see {self.log_path}:\n{self.log_tail()}"
            )
        ready = json.loads(line)
        assert isinstance(ready, dict)
        return ready

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def python_child(
    name: str,
    module: str,
    args: list[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    wait_line: bool = True,
) -> Child:
    """A ``python -m module args`` child with this interpreter."""
    return Child(
        name, [sys.executable, "-m", module, *args], log_path, env=env, wait_line=wait_line
    )


class CpuMeter:
    """CPU seconds of a set of processes between ``start()`` and ``stop()``.

    ``sources`` maps a name to a function returning that process's CPU seconds so far.
    """

    def __init__(self, sources: Mapping[str, object]) -> None:
        self._sources = dict(sources)
        self._start: dict[str, float] = {}
        self._wall = 0.0
        self.seconds: dict[str, float] = {}
        self.wall_s = 0.0

    def _read(self) -> dict[str, float]:
        values = {}
        for name, source in self._sources.items():
            assert callable(source)
            values[name] = float(source())
        return values

    def start(self) -> None:
        self._start = self._read()
        self._wall = time.monotonic()

    def stop(self) -> dict[str, float]:
        end = self._read()
        self.wall_s = time.monotonic() - self._wall
        self.seconds = {name: end[name] - self._start[name] for name in end}
        return self.seconds
