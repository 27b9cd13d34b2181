"""PostgreSQL text cannot hold NUL (U+0000): the store answers an id or a text with one
as the client's mistake, ``InvalidArgument``/``NUL_CHARACTER``, not as an internal error.
Found by ``tests/hardening/test_chat_fuzz.py`` (a Chat ``open`` with a NUL in its session
id was ``INTERNAL``)."""

from __future__ import annotations

import pytest

from service.adapters.store import SqlSessionStore, make_engine, migrate
from service.core.errors import InvalidArgument


@pytest.mark.postgres
async def test_nul_in_text_is_invalid_argument_on_postgresql(pg_url: str) -> None:
    await migrate(pg_url)
    engine = make_engine(pg_url)
    try:
        with pytest.raises(InvalidArgument) as caught:
            await SqlSessionStore(engine, "replica-a").get_session("bad\x00id")
        assert caught.value.reason == "NUL_CHARACTER"
    finally:
        await engine.dispose()
