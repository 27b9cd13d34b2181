"""The programs of the polyglot tests: Node with the grpc-js client of
``tests/polyglot/node`` (installed by ``npm ci``), and nginx (Debian's package) started
on loopback with a configuration written at run time.

A missing program skips the tests on a developer's machine and fails them in CI
(``CI=true``) or with ``BALLET_REQUIRE_POLYGLOT=1`` (set by .ci/run).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NODE_DIR = Path(__file__).resolve().parent / "node"
#: The API's proto roots, as the Node client loads them.
PROTO_PATH = os.pathsep.join(str(REPO / name) for name in ("proto", "third_party"))
_TRUE = {"1", "true", "yes", "on"}


class ProgramMissing(Exception):
    """node, the installed Node packages or nginx are not there."""


def polyglot_required() -> bool:
    """Whether a missing program fails the tests instead of skipping them: in CI (``CI``
    truthy) or with ``BALLET_REQUIRE_POLYGLOT=1`` (.ci/run)."""
    return any(
        os.environ.get(flag, "").strip().lower() in _TRUE
        for flag in ("CI", "BALLET_REQUIRE_POLYGLOT")
    )


def find_node() -> str:
    """The ``node`` program, with the client's packages installed. Raises
    ``ProgramMissing`` saying how to install what is missing."""
    node = shutil.which("node")
    if node is None:
        raise ProgramMissing("node is not installed (apt-get install nodejs)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        raise ProgramMissing(f"the Node packages are not installed (npm ci --prefix {NODE_DIR})")
    return node


def find_nginx() -> str:
    """The ``nginx`` program (on PATH or in /usr/sbin). Raises ``ProgramMissing``."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if found is None:
        raise ProgramMissing("nginx is not installed (apt-get install nginx-light)")
    return found


@dataclass
class NodeRun:
    """What one run of the Node client printed: its steps by name, stderr, exit code."""

    returncode: int
    steps: dict[str, dict[str, Any]]
    stderr: str
    #: Milliseconds from the client's start to each step.
    times: dict[str, int | None]

    def check(self) -> NodeRun:
        assert self.returncode == 0 and "done" in self.steps, (self.steps, self.times, self.stderr)
        return self


async def run_node(
    node: str, scenario: str, address: str, token: str, *, limit_s: float, **env: str
) -> NodeRun:
    """Run ``node client.js SCENARIO`` against ``address`` with ``token``; ``env`` are
    more of its settings (``HOLD_S``, ``KEEPALIVE_MS``). Killed after ``limit_s``."""
    process = await asyncio.create_subprocess_exec(
        node,
        str(NODE_DIR / "client.js"),
        scenario,
        cwd=NODE_DIR,
        env={
            "PATH": os.environ.get("PATH", ""),
            "PLANNER_ADDRESS": address,
            "TOKEN": token,
            "PROTO_PATH": PROTO_PATH,
            **env,
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), limit_s)
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    steps = {line.pop("step"): line for line in lines}
    times = {step: fields.pop("at_ms", None) for step, fields in steps.items()}
    return NodeRun(process.returncode or 0, steps, err.decode(), times)


NGINX_CONF = """\
worker_processes 1;
{user}
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    # Every timeout, buffer and http2 setting is nginx's default.
    server {{
        listen 127.0.0.1:{port} http2;
        location / {{
            grpc_pass grpc://{upstream};
        }}
    }}
}}
"""


class Nginx:
    """nginx in the foreground on a loopback port it is handed, passing gRPC to
    ``upstream``.

    The test binds and listens on port 0 itself and hands the socket to nginx through
    the ``NGINX`` environment variable (the inherited sockets of nginx's binary upgrade),
    whose ``listen`` names the same address: no port is picked for nginx to bind later
    (decision 0322)."""

    def __init__(self, program: str, directory: Path, upstream: str) -> None:
        self.directory = directory
        with socket.socket() as handed:
            handed.bind(("127.0.0.1", 0))
            handed.listen(256)
            self.port = handed.getsockname()[1]
            self.address = f"127.0.0.1:{self.port}"
            self.process = self._start(program, upstream, handed.fileno())
            if not self._listening():
                raise AssertionError(f"nginx did not start: {self.log()}")

    def _start(self, program: str, upstream: str, fd: int) -> subprocess.Popen[bytes]:
        # Workers of a root master run as the user named here; elsewhere it is unused.
        user = "user root;" if os.geteuid() == 0 else ""
        conf = self.directory / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(user=user, dir=self.directory, port=self.port, upstream=upstream)
        )
        (self.directory / "nginx.pid").unlink(missing_ok=True)
        return subprocess.Popen(
            [program, "-p", str(self.directory), "-c", str(conf), "-g", "daemon off;"],
            env={**os.environ, "NGINX": f"{fd};"},
            pass_fds=(fd,),
            stdout=subprocess.DEVNULL,
            stderr=(self.directory / "stderr.log").open("w"),
        )

    def _listening(self, limit_s: float = 15) -> bool:
        """Whether this nginx serves on the handed socket: its master writes the pid file
        once its listening sockets are set up; False when it exited."""
        pid_file = self.directory / "nginx.pid"
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if pid_file.exists() and pid_file.read_text().strip() == str(self.process.pid):
                socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
                return True
            try:
                self.process.wait(0.05)
            except subprocess.TimeoutExpired:
                continue
            return False
        raise AssertionError(f"nginx did not listen within {limit_s} s: {self.log()}")

    def log(self) -> str:
        logs = [self.directory / name for name in ("stderr.log", "error.log")]
        return "\n".join(path.read_text() for path in logs if path.exists())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
