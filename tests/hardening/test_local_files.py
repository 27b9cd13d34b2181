"""Files holding transcripts or secrets are owner-only whatever the umask:
``planner.db`` (with its WAL files), ``devstack.db``, the dev secret and the page-token
key are created ``0600`` in a ``0700`` data directory, even under ``umask 000``; a dev
secret that others can read is used with a WARNING. A database file that is not one is
refused at start-up in one line and left as it was."""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from ballet_common.files import DatabaseFileError, check_sqlite_file, create_private_file
from ballet_common.tokens import dev_secret
from devstack.server import DevStack, DevStackConfig
from tests.hardening.support import PlannerProcess, _wait_serving, planner_command


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def spawn_serve_under_umask_000(data_dir: Path, log_path: Path) -> PlannerProcess:
    """``ballet-planner serve`` (dev mode, SQLite) whose umask is 000: the worst case,
    where every file it makes would be world-writable unless it sets modes itself."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BALLET_PLANNER__")}
    env.update(
        {
            "BALLET_PLANNER__DATA_DIR": str(data_dir),
            "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
            "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "",
        }
    )
    ready_path = log_path.with_name("serve.ready.json")
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*planner_command(), "serve", "--ready-file", str(ready_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.umask(0),
        )
    return PlannerProcess(process, "", "", log_path, ready_path)


async def test_serve_under_umask_000_creates_owner_only_files(tmp_path: Path) -> None:
    data_dir = tmp_path / "state" / "data"
    served = spawn_serve_under_umask_000(data_dir, tmp_path / "serve.log")
    try:
        await _wait_serving(served)
        assert mode(data_dir) == 0o700
        for name in ("planner.db", "planner.db-wal", "planner.db-shm", "dev-secret"):
            assert mode(data_dir / name) == 0o600, name
        assert mode(data_dir / "page-token-key") == 0o600
    finally:
        served.stop()


async def test_the_devstack_under_umask_000_creates_owner_only_files(tmp_path: Path) -> None:
    data_dir = tmp_path / "devstack-data"
    previous = os.umask(0)
    try:
        stack = await DevStack.start(DevStackConfig(data_dir=data_dir, address="127.0.0.1:0"))
    finally:
        os.umask(previous)
    try:
        assert mode(data_dir) == 0o700
        assert mode(data_dir / "devstack.db") == 0o600
        assert mode(data_dir / "dev-secret") == 0o600
    finally:
        await stack.stop()


def test_an_existing_directory_keeps_its_mode_and_a_readable_secret_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)  # an operator's choice: left alone
    secret = dev_secret(shared)
    assert mode(shared) == 0o755 and mode(shared / "dev-secret") == 0o600
    with caplog.at_level(logging.WARNING):
        assert dev_secret(shared) == secret
    assert not caplog.records
    (shared / "dev-secret").chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert dev_secret(shared) == secret
    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING and "readable by other users" in warning.getMessage()


def test_a_file_that_is_not_a_sqlite_database_is_named_with_what_to_do(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    check_sqlite_file(empty)  # what create_private_file makes: a valid empty database
    real = tmp_path / "real.db"
    with sqlite3.connect(real) as connection:
        connection.execute("CREATE TABLE t (x)")
    connection.close()
    check_sqlite_file(real)
    damaged = real.read_bytes()
    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(4096))
    header_only = tmp_path / "header.db"
    header_only.write_bytes(damaged[:100] + b"\x00" * (len(damaged) - 100))
    for path in (junk, header_only):
        before = path.read_bytes()
        expected = f"^{re.escape(str(path))} is not a SQLite .*move it away"
        with pytest.raises(DatabaseFileError, match=expected):
            check_sqlite_file(path)
        assert path.read_bytes() == before


async def test_the_devstack_refuses_a_devstack_db_that_is_not_a_database(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    junk = os.urandom(4096)
    (data_dir / "devstack.db").write_bytes(junk)
    with pytest.raises(DatabaseFileError, match=r"devstack\.db is not a SQLite database"):
        await DevStack.start(DevStackConfig(data_dir=data_dir, address="127.0.0.1:0"))
    assert (data_dir / "devstack.db").read_bytes() == junk


def race_to_create(path: Path, contents: list[bytes]) -> tuple[list[bool], set[bytes]]:
    """One writer thread a content, all calling ``create_private_file(path, ...)`` at once,
    while a reader reads ``path`` as fast as it can: what each writer got, and every
    content the reader saw."""
    created: list[bool] = []
    seen: set[bytes] = set()
    start, done = threading.Barrier(len(contents) + 1), threading.Event()

    def write(content: bytes) -> None:
        start.wait()
        created.append(create_private_file(path, content))

    def read() -> None:
        start.wait()
        while not done.is_set():
            try:
                seen.add(path.read_bytes())
            except FileNotFoundError:
                continue

    reader = threading.Thread(target=read)
    writers = [threading.Thread(target=write, args=(content,)) for content in contents]
    reader.start()
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    done.set()
    reader.join()
    return created, seen


def test_processes_racing_to_create_a_secret_never_read_it_empty_or_half_written(
    tmp_path: Path,
) -> None:
    """Two replicas starting together on one data directory both create the dev page-token
    key: the loser must read the winner's whole key, never an empty file (one did, and
    refused to start with "no page token key"). Eight writers of 1 MiB race each round
    while a reader looks at the file as fast as it can."""
    contents = [f"{writer:02d}".encode() * (1 << 19) for writer in range(8)]
    for round_ in range(10):
        path = tmp_path / f"round-{round_}" / "secret"
        created, seen = race_to_create(path, contents)
        assert created.count(True) == 1
        assert path.read_bytes() in contents
        assert seen <= set(contents), "a reader saw the file empty or half written"
        assert mode(path) == 0o600
        assert [entry.name for entry in path.parent.iterdir()] == ["secret"]
