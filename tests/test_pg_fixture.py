"""The PostgreSQL fixtures give working databases, and a cluster survives a restart."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tests.pg import ExternalPg, PgCluster, PgServer, postgres_required


def libpq(sqlalchemy_url: str) -> str:
    """The psycopg form of a fixture's SQLAlchemy URL."""
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.mark.postgres
async def test_pg_url_is_a_fresh_database_sqlalchemy_can_use(pg_url: str) -> None:
    engine = create_async_engine(pg_url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1
            database = (await conn.execute(text("SELECT current_database()"))).scalar_one()
            tables = (
                await conn.execute(
                    text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    assert pg_url.endswith(f"/{database}")
    assert tables == 0


@pytest.mark.postgres
def test_dropped_database_is_gone(pg_cluster: PgServer) -> None:
    # Unique, since BALLET_TEST_DATABASE_URL's server may be shared by concurrent runs.
    name = f"test_drop_{uuid.uuid4().hex[:12]}"
    pg_cluster.create_database(name)
    # An open session must not block the drop (the fixture drops WITH (FORCE)).
    with psycopg.connect(libpq(pg_cluster.url(name))) as lingering:
        pg_cluster.drop_database(name)
        with pytest.raises(psycopg.OperationalError):
            lingering.execute("SELECT 1")
    with psycopg.connect(pg_cluster.admin_url()) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name]).fetchone()
    assert row == (0,)


@pytest.mark.postgres
@pytest.mark.slow
async def test_own_cluster_keeps_its_data_across_stop_and_start(
    own_pg_cluster: PgCluster,
) -> None:
    own_pg_cluster.create_database("app")
    url = libpq(own_pg_cluster.url("app"))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("CREATE TABLE kept (n int)")
        await conn.execute("INSERT INTO kept VALUES (42)")

    own_pg_cluster.stop()
    assert not own_pg_cluster.is_running()
    with pytest.raises(psycopg.OperationalError):
        await psycopg.AsyncConnection.connect(url, connect_timeout=2)

    own_pg_cluster.start()
    assert own_pg_cluster.is_running()
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cursor = await conn.execute("SELECT n FROM kept")
        assert await cursor.fetchall() == [(42,)]


@pytest.mark.postgres
@pytest.mark.slow
def test_own_cluster_recovers_from_an_immediate_stop(own_pg_cluster: PgCluster) -> None:
    url = own_pg_cluster.admin_url()
    with psycopg.connect(url, autocommit=True) as conn:
        # The cluster commits asynchronously; only a synchronous commit is sure to be in
        # the WAL when the server is killed.
        conn.execute("SET synchronous_commit = on")
        conn.execute("CREATE TABLE survived (n int)")
        conn.execute("INSERT INTO survived VALUES (7)")
    # "immediate" is a crash as far as PostgreSQL knows; the next start replays the WAL.
    own_pg_cluster.stop(mode="immediate")
    own_pg_cluster.start()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT n FROM survived").fetchall() == [(7,)]


def test_external_server_urls_keep_credentials_and_swap_the_database() -> None:
    server = ExternalPg("postgresql://ci:p%40ss@db.test:5433/maint")
    assert server.url("t1") == "postgresql+psycopg://ci:p%40ss@db.test:5433/t1"
    assert server.admin_url() == "postgresql://ci:p%40ss@db.test:5433/maint"
    assert ExternalPg("postgresql+psycopg://u@h/").admin_url() == "postgresql://u@h/postgres"
    with pytest.raises(ValueError):
        ExternalPg("sqlite:///x.db")


@pytest.mark.parametrize(
    ("env", "required"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"CI": "false"}, False),
        ({"BALLET_REQUIRE_POSTGRES": "1"}, True),
        ({"BALLET_REQUIRE_POSTGRES": "0"}, False),
    ],
)
def test_postgres_is_required_in_ci(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], required: bool
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BALLET_REQUIRE_POSTGRES", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert postgres_required() is required
