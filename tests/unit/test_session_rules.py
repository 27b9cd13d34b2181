"""The session rules with in-memory fakes: ownership, scopes, pagination, project checks."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
from typing import Any

import pytest

from service.core.errors import ECHO_MAX_CHARS, InvalidArgument, NotFound, PermissionDenied
from service.core.pages import PageTokens
from service.core.projects import ProjectDirectory
from service.core.sessions import (
    READ_SCOPE,
    Caller,
    ProjectAccess,
    SessionLimits,
    SessionRules,
)
from tests.memory_store import MemoryStore
from tests.unit.fakes import FakeClock
from tests.unit.session_fakes import FakeTracker

ALICE = Caller("alice", "acme", token="alice-token")
BOB = Caller("bob", "acme", token="bob-token")
READER = Caller("service:reports", "acme", service=True, scopes=frozenset({READ_SCOPE}))
FOREIGN_READER = Caller("service:reports", "globex", service=True, scopes=frozenset({READ_SCOPE}))
SCOPELESS = Caller("service:other", "acme", service=True, scopes=frozenset({"something.else"}))
KEYS = [b"page-token-key-for-the-unit-tests-0001"]


class World:
    def __init__(self, *, page_max_bytes: int = 1024 * 1024) -> None:
        self.store = MemoryStore()
        self.tracker = FakeTracker()
        self.clock = FakeClock()
        self.tracker.allow("alice", "demo")
        self.tracker.allow("bob", "demo")
        ids = (f"s{n:04d}" for n in itertools.count(1))
        directory = ProjectDirectory(self.tracker, self.clock, cache_s=60, timeout_s=5)  # type: ignore[arg-type]
        self.projects = ProjectAccess(directory)
        self.rules = SessionRules(
            self.store,  # type: ignore[arg-type]
            self.projects,
            self.clock,
            SessionLimits(page_max_bytes=page_max_bytes),
            page_tokens=PageTokens(lambda: KEYS),
            message_size=lambda m: len(m.text),
            new_id=lambda: next(ids),
        )

    async def create(self, caller: Caller = ALICE, request_id: str = "r1", **kw: Any) -> Any:
        return await self.rules.create_session(
            caller,
            request_id=request_id,
            project_id=kw.get("project_id", "demo"),
            title=kw.get("title", ""),
        )


async def test_create_checks_the_project_as_the_human() -> None:
    world = World()
    session = await world.create(title="Plan")
    assert (session.owner_id, session.project_id, session.organization_id) == (
        "alice",
        "demo",
        "acme",
    )
    acting, project = world.tracker.calls[0]
    assert (acting.human_id, acting.token, project) == ("alice", "alice-token", "demo")
    assert acting.actor == f"planner:{session.session_id}"


async def test_create_is_idempotent_on_the_request_id() -> None:
    world = World()
    first = await world.create(request_id="same", title="A")
    again = await world.create(request_id="same", title="A")
    assert again.session_id == first.session_id
    with pytest.raises(InvalidArgument) as refused:
        await world.create(request_id="same", title="B")
    assert refused.value.reason == "REQUEST_ID_REUSED"


@pytest.mark.parametrize(
    ("request_id", "project_id", "title", "reason"),
    [
        ("", "demo", "", "REQUEST_ID_REQUIRED"),
        ("x" * 65, "demo", "", "REQUEST_ID_TOO_LONG"),
        ("r", "", "", "PROJECT_ID_REQUIRED"),
        ("r", "demo", "t" * 257, "TITLE_TOO_LONG"),
    ],
)
async def test_create_validates_input(
    request_id: str, project_id: str, title: str, reason: str
) -> None:
    world = World()
    with pytest.raises(InvalidArgument) as refused:
        await world.create(request_id=request_id, project_id=project_id, title=title)
    assert refused.value.reason == reason
    assert world.tracker.calls == []


async def test_create_accepts_a_64_character_request_id() -> None:
    world = World()
    await world.create(request_id="x" * 64)


async def test_create_refuses_an_unreadable_or_foreign_project() -> None:
    world = World()
    with pytest.raises(NotFound) as missing:
        await world.create(project_id="secret")
    assert missing.value.reason == "PROJECT_NOT_FOUND"
    world.tracker.allow("alice", "elsewhere", organization="globex")
    with pytest.raises(NotFound):
        await world.create(project_id="elsewhere")
    assert world.store.sessions == {}


async def test_service_principals_never_create_or_change() -> None:
    world = World()
    session = await world.create()
    with pytest.raises(PermissionDenied) as refused:
        await world.create(READER)
    assert refused.value.reason == "HUMAN_REQUIRED"
    for change in (
        world.rules.update_title(READER, session.session_id, "x"),
        world.rules.delete_session(READER, session.session_id),
        world.rules.owned_session(READER, session.session_id),
    ):
        with pytest.raises(PermissionDenied):
            await change


async def test_another_humans_session_is_not_found() -> None:
    world = World()
    session = await world.create()
    sid = session.session_id
    world.store.add_turn(sid, "t1")
    for attempt in (
        world.rules.get_session(BOB, sid),
        world.rules.update_title(BOB, sid, "mine now"),
        world.rules.delete_session(BOB, sid),
        world.rules.get_turn(BOB, sid, "t1"),
        world.rules.list_messages(
            BOB, session_id=sid, after_sequence=0, page_size=0, page_token=""
        ),
        world.rules.owned_session(BOB, sid),
    ):
        with pytest.raises(NotFound) as hidden:
            await attempt
        assert hidden.value.reason == "SESSION_NOT_FOUND"
    missing = await _raises(world.rules.get_session(BOB, "no-such-session"))
    assert missing.reason == "SESSION_NOT_FOUND"
    assert world.store.sessions[sid].title == ""


async def _raises(awaitable: Any) -> Any:
    with pytest.raises(NotFound) as caught:
        await awaitable
    return caught.value


async def test_a_service_principal_reads_within_its_organization() -> None:
    world = World()
    session = await world.create()
    world.store.add_turn(session.session_id, "t1")
    read = await world.rules.get_session(READER, session.session_id)
    assert read == dataclasses.replace(session, running_turn_id="t1")
    assert (await world.rules.get_turn(READER, session.session_id, "t1")).turn_id == "t1"
    page = await world.rules.list_sessions(READER, project_id="demo", page_size=0, page_token="")
    assert [s.session_id for s in page.sessions] == [session.session_id]
    await _raises(world.rules.get_session(FOREIGN_READER, session.session_id))
    with pytest.raises(PermissionDenied) as refused:
        await world.rules.get_session(SCOPELESS, session.session_id)
    assert refused.value.reason == "MISSING_SCOPE"
    with pytest.raises(PermissionDenied):
        await world.rules.list_sessions(SCOPELESS, project_id="demo", page_size=0, page_token="")


async def test_list_sessions_shows_a_human_only_their_own() -> None:
    world = World()
    mine = await world.create(ALICE, "a")
    await world.create(BOB, "b")
    page = await world.rules.list_sessions(ALICE, project_id="demo", page_size=0, page_token="")
    assert [s.session_id for s in page.sessions] == [mine.session_id]
    with pytest.raises(InvalidArgument) as refused:
        await world.rules.list_sessions(ALICE, project_id="", page_size=0, page_token="")
    assert refused.value.reason == "PROJECT_ID_REQUIRED"


async def test_walking_250_sessions_by_100_gives_each_once_newest_first() -> None:
    world = World()
    for n in range(250):
        await world.create(request_id=f"r{n}")
        if n % 3 == 0:  # ties on create_time are broken by id
            world.clock.advance(1)
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await world.rules.list_sessions(
            ALICE, project_id="demo", page_size=100, page_token=token
        )
        pages += 1
        seen.extend(s.session_id for s in page.sessions)
        token = page.next_page_token
        if not token:
            break
    assert pages == 3
    assert len(seen) == len(set(seen)) == 250
    ordered = sorted(
        world.store.sessions.values(), key=lambda s: (s.create_time, s.session_id), reverse=True
    )
    assert seen == [s.session_id for s in ordered]


@pytest.mark.parametrize(("requested", "expected"), [(0, 50), (7, 7), (100, 100), (5000, 100)])
async def test_page_size_default_and_cap(requested: int, expected: int) -> None:
    world = World()
    await world.rules.list_sessions(ALICE, project_id="demo", page_size=requested, page_token="")
    assert world.store.list_calls[-1].page_size == expected


async def test_negative_page_size_is_refused() -> None:
    world = World()
    for call in (
        world.rules.list_sessions(ALICE, project_id="demo", page_size=-1, page_token=""),
        world.rules.list_messages(
            ALICE, session_id="x", after_sequence=0, page_size=-5, page_token=""
        ),
    ):
        with pytest.raises(InvalidArgument) as refused:
            await call
        assert refused.value.reason == "INVALID_PAGE_SIZE"


def _tamper(token: str) -> list[str]:
    padded = token + "=" * (-len(token) % 4)
    body = json.loads(base64.urlsafe_b64decode(padded))
    body["p"]["id"] = "s0001"
    edited = base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")
    flipped = token[:-3] + ("A" if token[-3] != "A" else "B") + token[-2:]
    return [edited, flipped, token[:-4], token + "x", "not a token", "e30"]


async def test_tampered_or_foreign_page_tokens_are_refused() -> None:
    world = World()
    for n in range(5):
        await world.create(ALICE, f"a{n}")
        await world.create(BOB, f"b{n}")
    page = await world.rules.list_sessions(ALICE, project_id="demo", page_size=2, page_token="")
    token = page.next_page_token
    assert token
    for bad in _tamper(token):
        with pytest.raises(InvalidArgument) as refused:
            await world.rules.list_sessions(ALICE, project_id="demo", page_size=2, page_token=bad)
        assert refused.value.reason == "INVALID_PAGE_TOKEN"
    # Another human's token, and the same token for another project, are foreign.
    for caller, project in ((BOB, "demo"), (ALICE, "other")):
        with pytest.raises(InvalidArgument):
            await world.rules.list_sessions(
                caller, project_id=project, page_size=2, page_token=token
            )
    # A page size change between pages is allowed (AIP-158).
    await world.rules.list_sessions(ALICE, project_id="demo", page_size=3, page_token=token)


def test_page_tokens_round_trip() -> None:
    tokens = PageTokens(lambda: KEYS)
    query = {"a": "1"}
    token = tokens.encode("k", query, {"s": 5})
    assert tokens.decode(token, "k", query) == {"s": 5}
    with pytest.raises(InvalidArgument):
        tokens.decode(token, "other-kind", query)


def test_page_tokens_are_keyed_and_the_previous_key_still_verifies() -> None:
    old, new = b"old-page-token-key-0123456789abcdef", b"new-page-token-key-0123456789abcdef"
    query = {"a": "1"}
    before = PageTokens(lambda: [old]).encode("k", query, {"s": 5})
    # Rotation: the new key signs, the old one still verifies until it leaves the set.
    rotating = PageTokens(lambda: [new, old])
    assert rotating.decode(before, "k", query) == {"s": 5}
    assert rotating.encode("k", query, {"s": 5}) != before
    with pytest.raises(InvalidArgument):
        PageTokens(lambda: [new]).decode(before, "k", query)
    # Someone without the key cannot make a token, even knowing the format exactly.
    forged = PageTokens(lambda: [b"a-key-the-service-never-held-000000"]).encode(
        "k", query, {"s": 2**70}
    )
    with pytest.raises(InvalidArgument):
        rotating.decode(forged, "k", query)
    # Old unkeyed (version 1) tokens and oversized ones are refused without decoding.
    v1 = base64.urlsafe_b64encode(b'{"f":"x","p":{"s":5},"v":1}').decode().rstrip("=")
    for bad in (v1, "A" * 5000, "\u00e9" * 10):
        with pytest.raises(InvalidArgument):
            rotating.decode(bad, "k", query)


@pytest.mark.parametrize("position", [{"s": 2**70}, {"s": -1}, {"s": True}, {"s": "5"}, {}])
async def test_an_out_of_range_message_position_is_refused(position: dict[str, Any]) -> None:
    # The keyed token stops forgeries; the bounds check stops anything the key signs
    # that the store could not take (2**70 overflowed a bigint: INTERNAL before).
    world = World()
    session = await world.create()
    query = {"session_id": session.session_id, "after_sequence": "0"}
    token = PageTokens(lambda: KEYS).encode("messages", query, position)
    refused = await _raises_invalid(
        world.rules.list_messages(
            ALICE, session_id=session.session_id, after_sequence=0, page_size=0, page_token=token
        )
    )
    assert refused.reason == "INVALID_PAGE_TOKEN"


@pytest.mark.parametrize(
    "position",
    [
        {"t": "2026-11-30T12:00:00", "id": "s1"},  # no time zone
        {"t": "yesterday", "id": "s1"},
        {"t": "2026-11-30T12:00:00+00:00", "id": "x" * 300},
        {"t": 5, "id": "s1"},
    ],
)
async def test_an_out_of_range_session_position_is_refused(position: dict[str, Any]) -> None:
    world = World()
    query = {"project_id": "demo", "organization_id": "acme", "owner_id": "alice"}
    token = PageTokens(lambda: KEYS).encode("sessions", query, position)
    refused = await _raises_invalid(
        world.rules.list_sessions(ALICE, project_id="demo", page_size=0, page_token=token)
    )
    assert refused.reason == "INVALID_PAGE_TOKEN"


async def test_list_messages_pages_by_count_bytes_and_after_sequence() -> None:
    world = World(page_max_bytes=64 * 1024)
    session = await world.create()
    sid = session.session_id
    texts = ["a" * 10] * 5 + ["b" * 40_000, "c" * 40_000, "d" * 100_000, "e"]
    world.store.add_messages(sid, texts)

    async def walk(page_size: int, after: int = 0) -> list[list[int]]:
        pages: list[list[int]] = []
        token = ""
        while True:
            page = await world.rules.list_messages(
                ALICE, session_id=sid, after_sequence=after, page_size=page_size, page_token=token
            )
            pages.append([m.sequence for m in page.messages])
            token = page.next_page_token
            if not token:
                return pages

    # 64 KiB a page; the 100,000-byte message is alone on its page (at least one message).
    assert await walk(0) == [[1, 2, 3, 4, 5, 6], [7], [8], [9]]
    assert await walk(2) == [[1, 2], [3, 4], [5, 6], [7], [8], [9]]
    assert await walk(100, after=7) == [[8], [9]]
    assert await walk(0, after=9) == [[]]
    first = await world.rules.list_messages(
        ALICE, session_id=sid, after_sequence=0, page_size=2, page_token=""
    )
    with pytest.raises(InvalidArgument) as refused:
        await world.rules.list_messages(
            ALICE, session_id=sid, after_sequence=1, page_size=2, page_token=first.next_page_token
        )
    assert refused.value.reason == "INVALID_PAGE_TOKEN"
    with pytest.raises(InvalidArgument) as negative:
        await world.rules.list_messages(
            ALICE, session_id=sid, after_sequence=-1, page_size=0, page_token=""
        )
    assert negative.value.reason == "INVALID_AFTER_SEQUENCE"


async def test_project_checks_are_cached_at_most_60_seconds() -> None:
    world = World()
    session = await world.create()
    calls = len(world.tracker.calls)

    async def list_once() -> None:
        await world.rules.list_messages(
            ALICE, session_id=session.session_id, after_sequence=0, page_size=0, page_token=""
        )

    await list_once()
    world.clock.advance(59)
    await list_once()
    assert len(world.tracker.calls) == calls  # the create's answer is still fresh
    world.clock.advance(2)
    await list_once()
    assert len(world.tracker.calls) == calls + 1
    # Access withdrawn: refused once the cached answer has expired.
    del world.tracker.readable[("alice", "demo")]
    world.clock.advance(61)
    missing = await _raises(list_once())
    assert missing.reason == "PROJECT_NOT_FOUND"
    # A service principal is not re-checked with the tracker.
    before = len(world.tracker.calls)
    await world.rules.list_messages(
        READER, session_id=session.session_id, after_sequence=0, page_size=0, page_token=""
    )
    assert len(world.tracker.calls) == before


async def test_update_and_delete_by_the_owner() -> None:
    world = World()
    session = await world.create()
    world.clock.advance(5)
    updated = await world.rules.update_title(ALICE, session.session_id, "New title")
    assert (updated.title, updated.update_time) == ("New title", world.clock.now())
    world.store.add_turn(session.session_id, "t9")
    await world.rules.delete_session(ALICE, session.session_id)
    assert world.store.cancelled == ["t9"]
    await _raises(world.rules.get_session(ALICE, session.session_id))
    await _raises(world.rules.delete_session(ALICE, session.session_id))


async def test_get_turn_of_another_session_is_not_found() -> None:
    world = World()
    first = await world.create(request_id="1")
    second = await world.create(request_id="2")
    world.store.add_turn(second.session_id, "t2")
    missing = await _raises(world.rules.get_turn(ALICE, first.session_id, "t2"))
    assert missing.reason == "TURN_NOT_FOUND"
    assert (await world.rules.get_turn(ALICE, second.session_id, "t2")).turn_id == "t2"


async def test_a_cached_project_check_does_not_serve_another_organization() -> None:
    world = World()
    await world.create()  # alice@acme: the answer for (alice, demo) is cached
    elsewhere = Caller("alice", "other-org", token="alice-other-token")
    refused = await _raises(world.create(elsewhere, request_id="r2"))
    assert refused.reason == "PROJECT_NOT_FOUND"


async def _raises_invalid(awaitable: Any) -> Any:
    with pytest.raises(InvalidArgument) as caught:
        await awaitable
    return caught.value


async def test_a_human_who_lost_the_project_gets_not_found_from_every_session_use() -> None:
    # Not only ListMessages and Chat: every read and change re-checks (cached).
    world = World()
    session = await world.create()
    sid = session.session_id
    world.store.add_turn(sid, "t1")
    del world.tracker.readable[("alice", "demo")]
    world.clock.advance(61)
    for attempt in (
        world.rules.get_session(ALICE, sid),
        world.rules.list_sessions(ALICE, project_id="demo", page_size=0, page_token=""),
        world.rules.get_turn(ALICE, sid, "t1"),
        world.rules.list_messages(
            ALICE, session_id=sid, after_sequence=0, page_size=0, page_token=""
        ),
        world.rules.update_title(ALICE, sid, "x"),
        world.rules.delete_session(ALICE, sid),
        world.rules.owned_session(ALICE, sid),
    ):
        refused = await _raises(attempt)
        assert refused.reason == "PROJECT_NOT_FOUND"
    assert sid in world.store.sessions  # nothing changed
    # Access back: works at once (refusals are never cached).
    world.tracker.allow("alice", "demo")
    assert (await world.rules.get_session(ALICE, sid)).session_id == sid


async def test_a_human_token_with_a_scope_is_not_a_service_principal() -> None:
    # The claim alone proves nothing: only Caller.service (the issuer's proof) counts.
    world = World()
    session = await world.create()
    scoped_bob = Caller("bob", "acme", scopes=frozenset({READ_SCOPE}), token="bob-token")
    assert not scoped_bob.is_service and not scoped_bob.may_read_sessions
    refused = await _raises(world.rules.get_session(scoped_bob, session.session_id))
    assert refused.reason == "SESSION_NOT_FOUND"
    page = await world.rules.list_sessions(
        scoped_bob, project_id="demo", page_size=0, page_token=""
    )
    assert page.sessions == []


async def test_a_huge_identifier_gives_a_small_not_found_without_a_lookup() -> None:
    world = World()
    session = await world.create()
    huge = "x" * (1024 * 1024)
    calls = len(world.tracker.calls)
    for attempt in (
        world.rules.get_session(ALICE, huge),
        world.rules.owned_session(ALICE, huge),
        world.rules.get_turn(ALICE, session.session_id, huge),
        world.rules.list_sessions(ALICE, project_id=huge, page_size=0, page_token=""),
    ):
        refused = await _raises(attempt)
        assert len(refused.message) < 200
        assert all(len(value) <= ECHO_MAX_CHARS for value in refused.metadata.values())
    assert len(world.tracker.calls) == calls  # a 1 MiB project id is not sent to the tracker
