"""Fixtures every test tier may use: PostgreSQL servers and the shared data folder.

The server logic lives in tests/pg.py; this file only decides lifetimes and what a
missing prerequisite means. A missing PostgreSQL skips the tests that need it on a
developer's machine, but fails them in CI (``CI=true``) or with
``BALLET_REQUIRE_POSTGRES=1``, so a CI run can never go green without them. Tier-specific
fixtures belong in ``tests/<tier>/conftest.py``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.pg import ExternalPg, PgCluster, PgServer, PostgresNotFound, postgres_required

# The data sets shared by the project's repositories (a real tracker export, decision
# records, skills, recorded model streams): BALLET_SHARED_DATA, else the folder
# `shared/data` beside the checkout, where the team's machines keep it.
SHARED_DATA = Path(
    os.environ.get("BALLET_SHARED_DATA")
    or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)


def _unavailable(reason: str, *, required: bool) -> NoReturn:
    if required:
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def _started_cluster(prepare: Callable[[PgCluster], None] | None = None) -> PgCluster:
    try:
        cluster = PgCluster.temporary()
        if prepare is not None:
            prepare(cluster)
    except PostgresNotFound as exc:
        missing = str(exc)
    else:
        missing = ""
    if missing:
        # Outside the except block, so the report shows the reason, not a traceback chain.
        _unavailable(
            f"{missing} (tests fail instead of skipping with CI=true or BALLET_REQUIRE_POSTGRES=1)",
            required=postgres_required(),
        )
    try:
        cluster.start()
    except BaseException:
        cluster.destroy()
        raise
    return cluster


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgServer]:
    """The session's PostgreSQL server: BALLET_TEST_DATABASE_URL's, or a private cluster.

    Tests may only create and drop databases on it; a test that stops or restarts
    PostgreSQL uses `own_pg_cluster`.
    """
    external = os.environ.get("BALLET_TEST_DATABASE_URL")
    if external:
        yield ExternalPg(external)
        return
    cluster = _started_cluster()
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def pg_url(pg_cluster: PgServer) -> Iterator[str]:
    """A new, empty database for this test: its SQLAlchemy URL (postgresql+psycopg://)."""
    name = f"test_{uuid.uuid4().hex[:16]}"
    pg_cluster.create_database(name)
    try:
        yield pg_cluster.url(name)
    finally:
        pg_cluster.drop_database(name)


@pytest.fixture
def own_pg_cluster() -> Iterator[PgCluster]:
    """A running private cluster for this test alone, which it may stop and restart."""
    cluster = _started_cluster()
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def primary_and_standby() -> Iterator[tuple[PgCluster, PgCluster]]:
    """A running primary (durable, database ``planner``) and its running streaming
    standby, commits waiting for the standby (synchronous replication), for this test
    alone: it may stop the primary and promote the standby."""
    primary = _started_cluster(PgCluster.enable_replication)
    standby: PgCluster | None = None
    try:
        primary.create_database("planner")
        try:
            standby = primary.standby()
        except PostgresNotFound as exc:
            _unavailable(str(exc), required=postgres_required())
        standby.start()
        primary.make_synchronous()
        yield primary, standby
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data folder, ``SHARED_DATA`` (read-only in CI).

    Skips when it is absent, or fails with BALLET_REQUIRE_SHARED_DATA=1 (set by .ci/run).
    """
    if not SHARED_DATA.is_dir():
        _unavailable(
            f"shared data folder {SHARED_DATA} is absent (set BALLET_SHARED_DATA; "
            "BALLET_REQUIRE_SHARED_DATA=1 turns this skip into a failure)",
            required=os.environ.get("BALLET_REQUIRE_SHARED_DATA") == "1",
        )
    return SHARED_DATA
