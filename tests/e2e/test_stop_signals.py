"""Stopping ``ballet-planner dev`` and ``serve`` with signals, as people do (decisions
0185 and 0190; found by a new-user trial).

- Two Ctrl-C (or SIGTERM) during a long turn: the first starts the graceful stop and
  says what it waits for, the second skips to its end. The process exits 130 (143),
  with no crash, traceback or asyncio ERROR, and the turn is stored ``INTERRUPTED``.
  The crash this replaces was intermittent (a ``KeyboardInterrupt`` thrown into grpc's
  machinery), so the test runs it a few times.
- With a collector that is down or hangs, the process still exits within
  ``server.grace_s``, idle or with a turn to interrupt, and the spans it could not send
  are dropped with one WARNING per service.

Each wait reads what the process prints (``select`` with a deadline); nothing sleeps.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.dev_support import DevProcess, clean_env, command
from tests.e2e.test_cli_serve import serve_address, wait_serving
from tests.otlp import OtlpReceiver
from tests.ports import refused_port

pytestmark = pytest.mark.slow

#: A turn that streams for minutes unless it is stopped.
SLOW_SCENARIO = {
    "rules": [
        {
            "match": {"purpose": "turn"},
            "reply": {"text": "Slowly. " * 100, "chunk_chars": 2, "delay_ms": 250},
        }
    ]
}
#: The server's grace period in the tracing tests, and the writes' cancel grace.
GRACE_S = 4.0
CANCEL_GRACE_S = 1.0
WAIT_S = 30.0
CRASH_SIGNS = ("Traceback", "Segmentation fault", "Fatal Python error", '"level": "ERROR"')


def read_until(process: subprocess.Popen[str], text: str, timeout_s: float = WAIT_S) -> str:
    """Read ``process``'s stdout (raw, unbuffered) until ``text`` appears; what was read."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    printed = b""
    while text.encode() not in printed:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"no {text!r} in time:\n{printed.decode()}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                pytest.fail(f"ended without {text!r}:\n{printed.decode()}")
            printed += data
    return printed.decode()


def rest_of(process: subprocess.Popen[str]) -> str:
    """Everything ``process`` prints on stdout until it closes it."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    chunks: list[bytes] = []
    while data := os.read(fd, 65536):
        chunks.append(data)
    return b"".join(chunks).decode()


def start_turn(dev: DevProcess) -> subprocess.Popen[str]:
    """``ballet-planner chat --json --message`` against ``dev``, once the turn streams."""
    chat = subprocess.Popen(
        [
            *command(),
            "chat",
            "--address",
            dev.planner,
            "--user",
            "alice",
            "--data-dir",
            dev.data_dir,
            "--json",
            "--message",
            "tell me slowly",
        ],
        cwd=dev.cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    read_until(chat, '"textDelta"')
    return chat


def stored_turns(database: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT state, end_reason, error_message FROM turns").fetchall()
    return [tuple(row) for row in rows]


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(SLOW_SCENARIO))
    return path


@pytest.mark.parametrize(
    "signals",
    [(signal.SIGINT, signal.SIGINT)] * 3 + [(signal.SIGTERM, signal.SIGTERM)],
    ids=["sigint-1", "sigint-2", "sigint-3", "sigterm"],
)
def test_a_second_signal_during_a_turn_stops_dev_at_once_and_cleanly(
    tmp_path: Path, scenario: Path, signals: tuple[int, int]
) -> None:
    dev = DevProcess.start(["--scenario", str(scenario), "--data-dir", "data"], tmp_path)
    chat: subprocess.Popen[str] | None = None
    try:
        chat = start_turn(dev)
        first, second = signals
        dev.process.send_signal(first)
        said = read_until(dev.process, "press Ctrl-C again to stop at once")
        # Grace 20 s, cancel grace 5 s: the turn gets 13 s before it is interrupted.
        assert "stopping: 1 running turn gets up to 13 s to end, then is interrupted" in said
        assert "at most 20 s in all" in said
        dev.process.send_signal(second)
        code = dev.process.wait(WAIT_S)
        out = rest_of(dev.process)
    finally:
        dev.kill()
        if chat is not None:
            chat.kill()
            chat.wait(10)
    log = dev.log()
    assert code == 128 + second, f"exit {code}:\n{out}\n{log}"
    assert "stopping at once: interrupting 1 running turn" in out
    assert out.rstrip().endswith("ballet-planner dev: stopped"), out
    for sign in CRASH_SIGNS:
        assert sign not in out + log, log
    assert stored_turns(tmp_path / "data" / "planner.db") == [
        ("ended", "interrupted", "the planner is shutting down")
    ]


def test_one_signal_when_idle_stops_dev_quietly(tmp_path: Path, scenario: Path) -> None:
    dev = DevProcess.start(["--scenario", str(scenario), "--data-dir", "data"], tmp_path)
    code, out = dev.stop()
    assert code == 0, dev.log()
    assert "stopping: no turn running; at most 20 s" in out
    assert "stopped" in out


# --------------------------------------------------------------------------- tracing


@pytest.fixture(params=["nobody listening", "hang"])
def collector(request: pytest.FixtureRequest) -> Iterator[str]:
    """An OTLP endpoint that is down (a port nobody listens on) or that accepts the
    export and never answers."""
    if request.param == "nobody listening":
        with refused_port() as port:
            yield f"http://127.0.0.1:{port}"
        return
    receiver = OtlpReceiver("hang")
    try:
        yield receiver.start()
    finally:
        receiver.stop()


def assert_one_tracing_warning(log: str, services: int) -> None:
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    exporter = [line for line in lines if line["logger"].startswith("opentelemetry.exporter")]
    dropped = [line for line in lines if line["message"].startswith("tracing:")]
    # Only the exporter's retries while running may show; none once the stop began.
    assert all(line["level"] != "ERROR" for line in exporter), exporter
    assert len(dropped) <= services, dropped
    assert all(line["level"] == "WARNING" for line in dropped)


def test_serve_exits_within_its_grace_when_idle_and_the_collector_is_down(
    tmp_path: Path, collector: str, record_property: Callable[[str, object], None]
) -> None:
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=collector,
        OTEL_BSP_SCHEDULE_DELAY="50",
        BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
        BALLET_PLANNER__SERVER__METRICS_ADDRESS="127.0.0.1:0",
        BALLET_PLANNER__SERVER__GRACE_S=str(GRACE_S),
        BALLET_PLANNER__PLANNER__CANCEL_GRACE=str(CANCEL_GRACE_S),
    )
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [*command(), "serve", "--ready-file", "ready.json"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=log,
            text=True,
        )
    try:
        # Health checks make spans, which the exporter cannot deliver.
        address = serve_address(tmp_path / "ready.json", process, log_path)
        wait_serving(address, process, tmp_path)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(WAIT_S)
        elapsed = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    text = log_path.read_text()
    record_property("exited_after_sigterm_s", round(elapsed, 3))
    assert code == 0, text
    assert elapsed < GRACE_S, f"exited {elapsed:.2f} s after SIGTERM:\n{text}"
    assert_one_tracing_warning(text, services=1)


def test_dev_interrupts_a_turn_and_exits_within_its_grace_when_the_collector_is_down(
    tmp_path: Path, scenario: Path, collector: str, record_property: Callable[[str, object], None]
) -> None:
    (tmp_path / "planner.toml").write_text(
        f"[server]\ngrace_s = {GRACE_S}\n[planner]\ncancel_grace = {CANCEL_GRACE_S}\n"
    )
    dev = DevProcess.start(
        ["--config", "planner.toml", "--scenario", str(scenario), "--data-dir", "data"],
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT=collector,
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    chat: subprocess.Popen[str] | None = None
    try:
        chat = start_turn(dev)
        signalled = time.monotonic()
        dev.process.send_signal(signal.SIGTERM)
        code = dev.process.wait(WAIT_S)
        elapsed = time.monotonic() - signalled
        out = rest_of(dev.process)
    finally:
        dev.kill()
        if chat is not None:
            chat.kill()
            chat.wait(10)
    log = dev.log()
    record_property("exited_after_sigterm_s", round(elapsed, 3))
    assert code == 0, f"{out}\n{log}"
    assert elapsed < GRACE_S, f"exited {elapsed:.2f} s after SIGTERM:\n{out}\n{log}"
    assert stored_turns(tmp_path / "data" / "planner.db") == [
        ("ended", "interrupted", "the planner is shutting down")
    ]
    for sign in CRASH_SIGNS[:3]:
        assert sign not in out + log, log
    # The planner's spans and the devstack's: at most one WARNING each.
    assert_one_tracing_warning(log, services=2)
