"""The ``ballet-planner`` command as a user runs it: serve, health, token, migrate.

``serve`` starts with no configuration file, from a fresh working directory (so the
default data directory ``./.ballet-dev`` and its SQLite database are created there); only
the ports come from the environment, to stay clear of other runs. Waits poll health with a
bounded loop or read the health ``Watch`` stream; nothing sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import jwt
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from ballet_common.tokens import DEV_SERVICE_ISSUER, dev_service_key
from tests.e2e import dev_support
from tests.ports import ready_file, refused_port

GRACE_S = 3.0
RPCS = {
    "CreateSession",
    "GetSession",
    "ListSessions",
    "UpdateSession",
    "DeleteSession",
    "ListMessages",
    "GetTurn",
    "CancelTurn",
    "SendMessage",
    "Chat",
}


def command() -> list[str]:
    script = Path(sys.executable).with_name("ballet-planner")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def serve_address(ready: Path, process: subprocess.Popen[str], log: Path) -> str:
    """The address ``serve --ready-file READY`` bound (it was given port 0)."""
    return str(ready_file(ready, process, log=log)["address"])


def start_serve(cwd: Path, env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], str]:
    """``ballet-planner serve ARGS`` in ``cwd`` with ``env`` (the machine's ``BALLET_PLANNER__``,
    ``BALLET_OPENAI_`` and ``OTEL_`` variables left out), its output in
    ``cwd/serve.log``; returns the process and the address it bound once it has
    (``ready.json``), not waiting for SERVING."""
    with (cwd / "serve.log").open("w") as log:
        process = subprocess.Popen(
            [*command(), "serve", "--ready-file", "ready.json", *args],
            cwd=cwd,
            env=dev_support.clean_env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        return process, serve_address(cwd / "ready.json", process, cwd / "serve.log")
    except BaseException:
        process.kill()
        process.wait(10)
        raise


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BALLET_PLANNER__")}
    env.update(extra)
    return env


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*command(), *args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


@dataclass
class Served:
    process: subprocess.Popen[str]
    address: str
    cwd: Path


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    env = clean_env(
        BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
        BALLET_PLANNER__SERVER__METRICS_ADDRESS="127.0.0.1:0",
        BALLET_PLANNER__SERVER__GRACE_S=str(GRACE_S),
        BALLET_PLANNER__PLANNER__CANCEL_GRACE="1",
    )
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [*command(), "serve", "--ready-file", "ready.json"],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        address = serve_address(tmp_path / "ready.json", process, tmp_path / "serve.log")
        wait_serving(address, process, tmp_path)
        yield Served(process, address, tmp_path)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log.close()


def wait_serving(
    address: str, process: subprocess.Popen[str], cwd: Path, limit_s: float = 30
) -> None:
    deadline = time.monotonic() + limit_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(
                    f"serve exited with {process.returncode}:\n{(cwd / 'serve.log').read_text()}"
                )
            try:
                response = stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True
                )
            except grpc.RpcError:
                continue
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
    pytest.fail(f"not SERVING within {limit_s} s:\n{(cwd / 'serve.log').read_text()}")


def test_serve_without_configuration(served: Served) -> None:
    data_dir = served.cwd / ".ballet-dev"
    assert (data_dir / "planner.db").exists()
    assert (data_dir / "dev-secret").exists()
    health = run(["health", "--address", served.address], served.cwd)
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING")
    with grpc.insecure_channel(served.address) as channel:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        service = pool.FindServiceByName("ballet.planner.v1.PlannerService")
        assert {method.name for method in service.methods} == RPCS
        assert pool.FindServiceByName("grpc.health.v1.Health")
    log = (served.cwd / "serve.log").read_text()
    assert "dev mode" in log and "SQLite" in log
    # server.event_loop's default (decision 0390).
    assert "event loop uvloop)" in log


def test_sigterm_turns_health_not_serving_then_exits_within_grace(served: Served) -> None:
    with grpc.insecure_channel(served.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        # The open Watch stream keeps the server busy: shutdown cancels it at the grace.
        code = served.process.wait(timeout=GRACE_S + 5)
        elapsed = time.monotonic() - started
    assert code == 0
    assert elapsed < GRACE_S + 0.5, f"exited after {elapsed:.2f} s"


def test_health_without_a_server(tmp_path: Path) -> None:
    with refused_port() as port:
        address = f"127.0.0.1:{port}"
        for args in (["health", "--address", address], ["health", "--alive", "--address", address]):
            result = run([*args, "--timeout", "1"], tmp_path)
            assert result.returncode == 1
            assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_health_refuses_a_timeout_or_a_ca_bundle_it_cannot_use(tmp_path: Path) -> None:
    for timeout in ("0", "-1", "nan", "inf"):
        result = run(["health", "--timeout", timeout], tmp_path)
        assert result.returncode == 2, result.stderr
        assert "ballet-planner health: --timeout must be a number of seconds" in result.stderr
    for bundle in (tmp_path / "missing.pem", tmp_path):
        result = run(["health", "--tls-ca", str(bundle), "--timeout", "1"], tmp_path)
        assert result.returncode == 2, result.stderr
        assert f"ballet-planner health: cannot read the CA bundle {bundle}" in result.stderr
        assert "Traceback" not in result.stderr


def test_serve_writes_its_bound_ports_to_the_ready_file_and_removes_it(served: Served) -> None:
    ready = served.cwd / "ready.json"
    values = ready_file(ready, served.process)
    assert values["address"] == served.address and not served.address.endswith(":0")
    assert values["metrics_address"].startswith("127.0.0.1:")
    assert not values["metrics_address"].endswith(":0")
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(GRACE_S + 5) == 0
    assert not ready.exists()


def test_token_is_signed_with_the_data_dirs_secret(tmp_path: Path) -> None:
    result = run(
        ["token", "--user", "alice", "--data-dir", "state", "--ttl", "60", "--create-secret"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    secret = (tmp_path / "state" / "dev-secret").read_text().strip().encode()
    claims = jwt.decode(
        result.stdout.strip(), secret, algorithms=["HS256"], audience="ballet-planner"
    )
    assert (claims["sub"], claims["org"]) == ("alice", "acme")
    assert claims["exp"] - claims["iat"] == 60
    scoped = run(
        ["token", "--user", "svc", "--data-dir", "state", "--scope", "planner.sessions.read"],
        tmp_path,
    )
    # A service principal: signed by the dev service-token issuer, never the human key.
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(scoped.stdout.strip(), secret, algorithms=["HS256"], audience="ballet-planner")
    decoded = jwt.decode(
        scoped.stdout.strip(),
        dev_service_key(secret),
        algorithms=["HS256"],
        audience="ballet-planner",
        issuer=DEV_SERVICE_ISSUER,
    )
    assert decoded["scope"] == "planner.sessions.read"


def test_configuration_errors_name_the_key(tmp_path: Path) -> None:
    result = run(["serve"], tmp_path, BALLET_PLANNER__PLANNER__MAX_ROUNDS="0")
    assert result.returncode == 2
    assert "planner.max_rounds: must be >= 1, got 0" in result.stderr
    config = tmp_path / "planner.toml"
    config.write_text("[server]\nadress = '127.0.0.1:1'\n")
    result = run(["serve", "--config", str(config)], tmp_path)
    assert (result.returncode, "server.adress: unknown key" in result.stderr) == (2, True)
    result = run(["serve"], tmp_path, BALLET_PLANNER__SERVER__ADDRESS="0.0.0.0:50051")
    assert result.returncode == 2 and "dev mode" in result.stderr


def test_migrate_sqlite(tmp_path: Path) -> None:
    result = run(
        ["migrate", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "database schema at" in result.stdout
    again = run(["migrate", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"], tmp_path)
    assert again.returncode == 0


def test_token_refuses_a_lifetime_that_is_not_positive_and_an_empty_user(tmp_path: Path) -> None:
    for args in (
        ["--user", "alice", "--ttl", "0"],
        ["--user", "alice", "--ttl", "-5"],
        ["--user", " "],
    ):
        result = run(["token", *args, "--data-dir", "state"], tmp_path)
        assert result.returncode == 2
        assert "ballet-planner token:" in result.stderr


def test_the_database_flags_of_serve_migrate_and_purge(tmp_path: Path) -> None:
    # Every subcommand that opens the planner's database takes --database-url and
    # --data-dir, as dev does (decision 0324).
    migrated = run(["migrate", "--data-dir", "state"], tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    assert (tmp_path / "state" / "planner.db").exists()
    url = f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"
    served, address = start_serve(
        tmp_path,
        {
            "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
            "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "",
        },
        "--data-dir",
        "state",
        "--database-url",
        url,
    )
    try:
        wait_serving(address, served, tmp_path)
    finally:
        served.terminate()
        served.wait(30)
    assert (tmp_path / "state" / "dev-secret").exists() and (tmp_path / "other.db").exists()
    purged = run(["purge", "--data-dir", "state", "--human", "nobody", "--dry-run"], tmp_path)
    assert purged.returncode == 0, purged.stderr
