"""Helpers for the end-to-end tests of ``ballet-planner dev`` and ``ballet-planner chat``.

``DevProcess`` runs ``ballet-planner dev`` as a user does (a subprocess, free ports via
``127.0.0.1:0``) and reads the addresses from what it prints; ``Terminal`` runs a command
in a pseudo-terminal and waits for its output with a deadline (``select`` on the pty,
never a sleep); ``find_buf`` locates the buf CLI.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

REPO = Path(__file__).resolve().parents[2]
READY_LINE = "Stop with Ctrl-C."
#: ``dev``'s three servers each on a port of the kernel's choice (reported in its banner
#: and ready file).
ANY_PORTS = (
    "--address",
    "127.0.0.1:0",
    "--devstack-address",
    "127.0.0.1:0",
    "--metrics-address",
    "127.0.0.1:0",
)


def command() -> list[str]:
    """How to run ``ballet-planner`` from this virtualenv."""
    script = Path(sys.executable).with_name("ballet-planner")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any ``BALLET_PLANNER__``/``BALLET_OPENAI_`` setting of the
    machine, nor its ``OTEL_*`` (a collector of the machine's would get the tests'
    spans), plus ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.upper().startswith(("BALLET_PLANNER__", "BALLET_OPENAI_", "OTEL_"))
    }
    env.update(extra)
    return env


def run_cli(
    args: list[str], cwd: Path, *, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``ballet-planner ARGS`` to its end."""
    return subprocess.run(
        [*command(), *args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class DevProcess:
    """A running ``ballet-planner dev``: its printed banner and the addresses in it."""

    process: subprocess.Popen[str]
    cwd: Path
    log_path: Path
    data_dir: str = ".ballet-dev"
    banner: str = ""
    ready_s: float = 0.0
    planner: str = ""
    devstack: str = ""
    _log: IO[str] | None = field(default=None, repr=False)

    @classmethod
    def start(cls, args: list[str], cwd: Path, *, limit_s: float = 60, **env: str) -> DevProcess:
        """Start ``ballet-planner dev ARGS`` (port 0 for both servers unless ``args`` say
        otherwise; metrics on a free port) and wait until it prints its banner."""
        if "--address" not in args:
            args = [*args, "--address", "127.0.0.1:0"]
        if "--devstack-address" not in args:
            args = [*args, "--devstack-address", "127.0.0.1:0"]
        env.setdefault("BALLET_PLANNER__SERVER__METRICS_ADDRESS", "127.0.0.1:0")
        log_path = cwd / "dev.log"
        log = log_path.open("w")
        started = time.monotonic()
        process = subprocess.Popen(
            [*command(), "dev", *args],
            cwd=cwd,
            env=clean_env(**env),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        dev = cls(process, cwd, log_path, _log=log)
        if "--data-dir" in args:
            dev.data_dir = args[args.index("--data-dir") + 1]
        try:
            dev.banner = dev._read_banner(started + limit_s)
        except BaseException:
            dev.kill()
            raise
        dev.ready_s = time.monotonic() - started
        dev.planner = _address(dev.banner, "planner")
        dev.devstack = _address(dev.banner, "devstack")
        return dev

    def _read_banner(self, deadline: float) -> str:
        # Raw reads on the descriptor: a buffered readline would hide lines from select.
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        printed = b""
        while READY_LINE.encode() not in printed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"dev printed no banner in time:\n{printed.decode()}\n{self.log()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            data = os.read(fd, 65536)
            if not data:
                self.process.wait(10)
                pytest.fail(
                    f"dev exited with {self.process.returncode}:\n{printed.decode()}\n{self.log()}"
                )
            printed += data
        return printed.decode()

    def log(self) -> str:
        """What dev wrote on stderr so far (its logs)."""
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, timeout: float = 30) -> tuple[int, str]:
        """SIGINT, as Ctrl-C; returns the exit code and what it printed after the banner."""
        self.process.send_signal(signal.SIGINT)
        try:
            out, _ = self.process.communicate(timeout=timeout)
        finally:
            if self._log is not None:
                self._log.close()
        return self.process.returncode, out

    def kill(self) -> None:
        """Kill it (a failed start)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self._log is not None:
            self._log.close()

    def chat(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``ballet-planner chat ARGS`` against this planner, as alice from its data dir
        unless ``args`` name another user or a token."""
        extra = ["--address", self.planner]
        if "--user" not in args and "--token" not in args:
            extra += ["--user", "alice"]
        if "--data-dir" not in args:
            extra += ["--data-dir", self.data_dir]
        return run_cli(["chat", *extra, *args], self.cwd, timeout=timeout)


def _address(banner: str, name: str) -> str:
    found = re.search(rf"^\s+{name}\s+(\S+:\d+)", banner, re.MULTILINE)
    assert found, f"no {name} address in the banner:\n{banner}"
    return found.group(1)


def find_buf() -> str:
    """The buf CLI: on PATH, or where CI installs it (.venv/buf). Missing, it skips the
    test, or fails it when CI=true."""
    found = shutil.which("buf")
    if found:
        return found
    local = REPO / ".venv" / "buf" / "node_modules" / ".bin" / "buf"
    if local.exists():
        return str(local)
    if os.environ.get("CI") == "true":
        pytest.fail("buf is not installed (CI installs it in .venv/buf and puts it on PATH)")
    pytest.skip("buf is not installed (put it on PATH, or run .ci/run)")


class Terminal:
    """A command in a pseudo-terminal: ``send`` types a line, ``expect`` waits for a
    pattern in the output after the previous match (a regex; ``timeout`` in seconds)."""

    def __init__(
        self, argv: list[str], cwd: Path, env: dict[str, str], *, controlling: bool = False
    ) -> None:
        """``controlling``: the command leads a session of its own whose controlling
        terminal is this one, as in a terminal window, so that ``hang_up`` is the window
        closing."""
        import pty

        master, slave = pty.openpty()
        self.process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            close_fds=True,
            start_new_session=controlling,
            preexec_fn=_take_the_terminal if controlling else None,
        )
        os.close(slave)
        self.fd = master
        self._open = True
        self.output = ""
        self._pos = 0

    def send(self, line: str) -> None:
        """Type ``line`` and Enter."""
        os.write(self.fd, (line + "\n").encode())

    def keys(self, keys: str) -> None:
        """Type ``keys`` as they are (escape sequences for arrows, "\\r" for Enter)."""
        os.write(self.fd, keys.encode())

    def expect(self, pattern: str, timeout: float = 15) -> re.Match[str]:
        """Wait until ``pattern`` appears after the last match; fail with the output."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = regex.search(self.output, self._pos)
            if found:
                self._pos = found.end()
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read(remaining):
                pytest.fail(f"no {pattern!r} in the terminal:\n{self.output}")

    def settle(self, seconds: float) -> str:
        """Read for ``seconds``; what came after the last match meanwhile."""
        deadline = time.monotonic() + seconds
        while self._read(max(0.0, deadline - time.monotonic())):
            pass
        return self.output[self._pos :]

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the process ended and the pty closed
            return False
        if not data:
            return False
        self.output += data.decode(errors="replace").replace("\r\n", "\n")
        return True

    def wait(self, timeout: float = 15) -> int:
        """Read to the end of the output and return the exit code."""
        deadline = time.monotonic() + timeout
        while self._read(max(0.0, deadline - time.monotonic())):
            pass
        return self.process.wait(max(0.1, deadline - time.monotonic()))

    def hang_up(self) -> None:
        """Close the terminal under the command, as closing its window does: the kernel
        sends its session SIGHUP, and writes to the terminal fail from then on."""
        if self._open:
            self._open = False
            os.close(self.fd)

    def close(self) -> None:
        """Kill the process if it still runs; close the pty."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.hang_up()


def _take_the_terminal() -> None:
    """In a child that leads a new session: make its stdin (a terminal) its controlling
    terminal."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
