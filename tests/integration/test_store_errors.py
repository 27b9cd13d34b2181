"""Database errors become domain errors in one place (``service.adapters.store.errors``).

The store's own locking makes the unique keys hard to hit through its methods, so these
tests violate them directly and check what ``translated()`` makes of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import SqlSessionStore, make_engine
from service.adapters.store.codec import turn_row
from service.adapters.store.errors import RequestIdTaken, translated
from service.adapters.store.tables import (
    UQ_SESSION_REQUEST_ID,
    UQ_TURN_REQUEST_ID,
    sessions,
    turns,
)
from service.core.errors import FailedPrecondition, StoreUnavailable
from tests.integration.store_support import new_session, turn_start


def _turn(turn_id: str, request_id: str) -> dict[str, object]:
    return {
        **turn_row(turn_start("s1", turn_id, request_id=request_id).turn),
        "project_id": "p1",
    }


async def test_a_second_running_turn_is_turn_in_progress(
    store: SqlSessionStore, engine: AsyncEngine
) -> None:
    await store.create_session(new_session("s1"))

    with pytest.raises(FailedPrecondition) as refused, translated():
        async with engine.begin() as conn:
            await conn.execute(insert(turns).values([_turn("t1", "r1"), _turn("t2", "r2")]))

    assert refused.value.reason == "TURN_IN_PROGRESS"


async def test_request_id_keys_are_recognised(store: SqlSessionStore, engine: AsyncEngine) -> None:
    await store.create_session(new_session("s1", request_id="c1", request_hash="h"))
    await store.start_turn(turn_start("s1", "t1", request_id="r1"))

    with pytest.raises(RequestIdTaken) as turn_key, translated():
        async with engine.begin() as conn:
            ended = {**_turn("t2", "r1"), "state": "ended"}
            await conn.execute(insert(turns).values(ended))
    assert turn_key.value.constraint == UQ_TURN_REQUEST_ID

    with pytest.raises(RequestIdTaken) as session_key, translated():
        async with engine.begin() as conn:
            await conn.execute(
                insert(sessions).values(
                    session_id="s2",
                    project_id="p1",
                    organization_id="acme",
                    owner_id="alice",
                    create_time=new_session().now,
                    update_time=new_session().now,
                    create_request_id="c1",
                )
            )
    assert session_key.value.constraint == UQ_SESSION_REQUEST_ID


async def test_an_unreachable_sqlite_database_is_unavailable(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'missing-dir' / 'planner.db'}")
    try:
        with pytest.raises(StoreUnavailable):
            await SqlSessionStore(engine, "replica-a").ping()
    finally:
        await engine.dispose()


async def test_an_unreachable_postgresql_is_unavailable() -> None:
    # Port 1 on loopback: nothing listens there, so the connection is refused at once.
    engine = make_engine("postgresql+psycopg://nobody@127.0.0.1:1/planner")
    try:
        store = SqlSessionStore(engine, "replica-a")
        with pytest.raises(StoreUnavailable):
            await store.ping()
        with pytest.raises(StoreUnavailable):
            await store.get_session("s1")
    finally:
        await engine.dispose()
