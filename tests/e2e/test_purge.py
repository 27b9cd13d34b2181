"""``ballet-planner purge`` as an operator runs it (a CronJob, an erasure request): what it
prints, what it deletes, and its exit codes (docs/retention.md).

Sessions are planted in a migrated database through the store, at fixed times long
past (idle) or now (active); each test then runs the real command in a subprocess with
the configuration in the environment only, as the CronJob does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from sqlalchemy import func, select

from service.adapters.store import SqlSessionStore, make_engine, migrate
from service.adapters.store.tables import messages, sessions
from service.server.retention import ERASURE_KEEPS
from tests.integration.store_support import end_commit, new_session, turn_start

LONG_AGO = datetime(2025, 1, 6, 9, 30, tzinfo=UTC)
IDLE_DAYS = "30"


def command() -> list[str]:
    script = Path(sys.executable).with_name("ballet-planner")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def purge(*args: str, database: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.upper().startswith("BALLET_PLANNER__")}
    environ["BALLET_PLANNER__DATABASE__URL"] = database
    environ.update({f"BALLET_PLANNER__{key}": value for key, value in env.items()})
    return subprocess.run(
        [*command(), "purge", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def _plant(url: str, *, running: str = "") -> None:
    """Alice: two idle sessions (one with two turns) and one active; Bob: one idle, one
    active. ``running`` names a session whose turn is left running."""
    await migrate(url)
    engine = make_engine(url)
    store = SqlSessionStore(engine, "planter", notify=False)
    now = datetime.now(UTC)
    try:
        for session_id, owner, at, turns in (
            ("alice-old-1", "alice", LONG_AGO, 2),
            ("alice-old-2", "alice", LONG_AGO, 1),
            ("alice-now", "alice", now, 1),
            ("bob-old", "bob", LONG_AGO, 1),
            ("bob-now", "bob", now, 1),
        ):
            await store.create_session(new_session(session_id, owner=owner, now=at))
            for index in range(turns):
                turn_id = f"{session_id}-t{index}"
                await store.start_turn(
                    turn_start(session_id, turn_id, human=owner, now=at, owner="planter")
                )
                if session_id != running:
                    await store.commit(end_commit(session_id, turn_id, now=at, owner="planter"))
    finally:
        await engine.dispose()


def plant(url: str, *, running: str = "") -> None:
    asyncio.run(_plant(url, running=running))


async def _left(url: str) -> tuple[set[str], int]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            ids = {str(v) for v in (await conn.execute(select(sessions.c.session_id))).scalars()}
            count = (await conn.execute(select(func.count()).select_from(messages))).scalar_one()
            return ids, int(count)
    finally:
        await engine.dispose()


def left(url: str) -> tuple[set[str], int]:
    """The sessions left, and the messages left in all."""
    return asyncio.run(_left(url))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'planner.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, sqlite_url: str) -> str:
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return sqlite_url


EVERYONE = {"alice-old-1", "alice-old-2", "alice-now", "bob-old", "bob-now"}


def test_a_pass_deletes_the_idle_sessions_and_says_so(database: str) -> None:
    plant(database)
    _, messages_before = left(database)

    dry = purge("--dry-run", database=database, RETENTION__SESSION_IDLE_DAYS=IDLE_DAYS)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(
        "retention (dry run): 3 session(s) with 4 message(s) last active before "
    )
    assert "(30 days) would be deleted; nothing was deleted" in dry.stdout
    assert left(database) == (EVERYONE, messages_before)

    done = purge(database=database, RETENTION__SESSION_IDLE_DAYS=IDLE_DAYS)

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("retention: deleted 3 session(s) with 4 message(s) last active")
    assert done.stdout.rstrip().endswith("(30 days), in 1 batch(es)")
    assert done.stderr == ""
    assert left(database) == ({"alice-now", "bob-now"}, messages_before - 4)
    again = purge("--json", database=database, RETENTION__SESSION_IDLE_DAYS=IDLE_DAYS)
    outcome = json.loads(again.stdout)
    assert outcome["kind"] == "idle" and outcome["sessions"] == 0 and outcome["complete"]


def test_an_erasure_deletes_everything_of_one_human_and_says_what_it_keeps(database: str) -> None:
    plant(database)

    dry = purge("--human", "alice", "--dry-run", database=database)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0] == (
        "erasure of human 'alice' (dry run): would delete 3 session(s) with 4 message(s) and "
        "0 open stream slot(s); nothing was deleted"
    )
    assert left(database)[0] == EVERYONE

    done = purge("--human", "alice", database=database)

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "erasure of human 'alice': deleted 3 session(s) with 4 message(s) and 0 open stream slot(s)"
    )
    # What it does not delete is said plainly, every time.
    assert lines[1:] == [f"kept: {kept}" for kept in ERASURE_KEEPS]
    assert "changesets" in lines[1] and "knowledge" in lines[1]
    assert left(database)[0] == {"bob-old", "bob-now"}
    as_json = json.loads(purge("--human", "alice", "--json", database=database).stdout)
    assert as_json["kind"] == "erasure" and as_json["sessions"] == 0
    assert as_json["kept"] == list(ERASURE_KEEPS) and as_json["complete"]


def test_an_erasure_that_leaves_a_running_turn_exits_1(sqlite_url: str) -> None:
    # Nobody runs the planted turn, so the cancel never lands: after the wait (here
    # cancel_grace 0 + lease 0.2 + sweep 0.1 + 2 s) its session is left and said so.
    plant(sqlite_url, running="alice-now")
    done = purge(
        "--human",
        "alice",
        database=sqlite_url,
        PLANNER__CANCEL_GRACE="0",
        PLANNER__LEASE_S="0.2",
        PLANNER__SWEEP_INTERVAL_S="0.1",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[:2] == [
        "erasure of human 'alice': deleted 2 session(s) with 3 message(s) and 0 open stream "
        "slot(s); 1 running turn(s) cancelled first",
        "incomplete: 1 session(s) of human 'alice' are left: a turn in them did not end in "
        "time, or they were created meanwhile; run the command again",
    ]
    assert left(sqlite_url)[0] == {"alice-now", "bob-old", "bob-now"}


def test_usage_and_configuration_errors_exit_2(sqlite_url: str) -> None:
    plant(sqlite_url)
    off = purge(database=sqlite_url)
    assert off.returncode == 2 and off.stdout == ""
    assert off.stderr.startswith("ballet-planner purge: retention is off")
    assert "BALLET_PLANNER__RETENTION__SESSION_IDLE_DAYS" in off.stderr
    nobody = purge("--human", " ", database=sqlite_url)
    assert (nobody.returncode, nobody.stderr) == (
        2,
        "ballet-planner purge: --human must name someone\n",
    )
    bad = purge(database=sqlite_url, RETENTION__SESSION_IDLE_DAYS="-1")
    assert bad.returncode == 2
    assert "retention.session_idle_days: must be >= 0, got -1" in bad.stderr
    # (Which usage a wrong flag prints is the command line's, not purge's.)
    assert purge("--humans", "x", database=sqlite_url).returncode == 2
    assert left(sqlite_url)[0] == EVERYONE


def test_a_database_it_cannot_use_exits_1(tmp_path: Path) -> None:
    missing = f"sqlite+aiosqlite:///{tmp_path / 'nothing-here.db'}"
    gone = purge("--human", "alice", database=missing)
    assert gone.returncode == 1
    where = tmp_path / "nothing-here.db"
    assert gone.stderr == f"ballet-planner purge: no SQLite database at {where}: nothing to purge\n"
    assert not (tmp_path / "nothing-here.db").exists()

    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    misplaced = purge("--human", "alice", database=f"sqlite+aiosqlite:///{a_file / 'planner.db'}")
    assert misplaced.returncode == 1
    assert misplaced.stderr == (
        f"ballet-planner purge: {a_file} is a file, not a folder: no SQLite database there\n"
    )

    empty = tmp_path / "empty.db"
    empty.touch()
    behind = purge("--human", "alice", database=f"sqlite+aiosqlite:///{empty}")
    assert behind.returncode == 1
    assert "schema has no tables yet (an empty database" in behind.stderr
    assert "ballet-planner migrate" in behind.stderr

    unreachable = purge(
        "--human", "alice", database="postgresql+psycopg://nobody@127.0.0.1:1/planner"
    )
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith("ballet-planner purge: the database is unreachable")
    assert unreachable.stderr.count("the database is") == 1, unreachable.stderr  # said once
    assert "Traceback" not in unreachable.stderr


class Pushgateway(BaseHTTPRequestHandler):
    """A Pushgateway's push endpoint: keeps each request's method, path and body."""

    received: list[tuple[str, str, str]] = []

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.received.append(("PUT", self.path, self.rfile.read(length).decode()))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def pushgateway() -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    received: list[tuple[str, str, str]] = []
    handler = type("Handler", (Pushgateway,), {"received": received})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_a_run_pushes_what_it_deleted_to_a_pushgateway(
    sqlite_url: str, pushgateway: tuple[str, list[tuple[str, str, str]]]
) -> None:
    url, received = pushgateway
    plant(sqlite_url)
    started = datetime.now(UTC) - timedelta(seconds=1)

    done = purge("--pushgateway", url, database=sqlite_url, RETENTION__SESSION_IDLE_DAYS=IDLE_DAYS)

    assert done.returncode == 0, done.stderr
    ((method, path, body),) = received
    assert (method, path) == ("PUT", "/metrics/job/ballet-planner-purge/reason/idle")
    values = {
        line.split()[0]: float(line.split()[1])
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    assert values["ballet_planner_purge_sessions_deleted"] == 3
    assert values["ballet_planner_purge_messages_deleted"] == 4
    assert values["ballet_planner_purge_last_success_timestamp_seconds"] >= started.timestamp()
    erasure = purge("--human", "bob", "--pushgateway", url, database=sqlite_url)
    assert erasure.returncode == 0, erasure.stderr
    assert received[-1][1] == "/metrics/job/ballet-planner-purge/reason/erasure"
    assert "bob" not in received[-1][2]


def test_a_failed_push_exits_1_after_the_work_is_done(sqlite_url: str) -> None:
    plant(sqlite_url)
    done = purge(
        "--pushgateway",
        "http://127.0.0.1:1",
        database=sqlite_url,
        RETENTION__SESSION_IDLE_DAYS=IDLE_DAYS,
    )
    assert done.returncode == 1
    assert done.stdout.startswith("retention: deleted 3 session(s)")
    assert done.stderr.startswith(
        "ballet-planner purge: done, but the push to http://127.0.0.1:1 failed"
    )
    assert left(sqlite_url)[0] == {"alice-now", "bob-now"}
