"""A property-based test of Chat: 2,000 random ``ChatRequest``
sequences over real Chat streams to one planner on PostgreSQL, with the devstack and a
scripted model that answers at once, cause no crash, no hang and no half-stored turn.

Each example opens one stream as alice or bob and sends a handful of requests: random
actions (or none), random or missing request ids (some over 64 characters), random
text in every text field (Unicode strings, and random bytes decoded as UTF-8 with
replacement, NUL included), ``after_sequence`` from negative to huge, session ids that
exist, belong to someone else or are made up. Then it half-closes and reads to the end.

Properties:

- no crash: no response or stream end is ``INTERNAL``/``UNKNOWN`` (a bug, not a
  refusal); after the run health is SERVING and a normal turn completes;
- no hang: every stream ends within ``STREAM_BOUND_S`` of its half-close;
- no half-stored turn: afterwards every turn has ended (none is left running), every
  tool call has a result, every turn has its ``message_accepted`` and one ``turn_ended``
  event, and each session's event sequences are 1..``last_sequence`` without gaps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, resources_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from service.adapters.store import make_engine
from tests.hardening.support import (
    Chat,
    Planner,
    Stack,
    create_session,
    error_info,
    start_stack,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

EXAMPLES = 2000
#: How long a stream may take to end after its half-close (seconds): the model answers
#: at once, so a turn takes milliseconds; this only tells a hang from a slow machine.
STREAM_BOUND_S = 10.0
#: Codes that mean a bug rather than a refusal.
BUG_CODES = {grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNKNOWN.value[0]}

RULES: list[dict[str, Any]] = [
    {
        "match": {"last_role": "human", "last_text_regex": "(?i)items"},
        "reply": {"tool_calls": [{"name": "list_items", "arguments": {}}]},
    },
    {
        "match": {"last_role": "human", "last_text_regex": "(?i)write"},
        "reply": {
            "tool_calls": [
                {
                    "name": "create_knowledge",
                    "arguments": {"kind": "note", "title": "fuzz", "body": "{{match:0}}"},
                }
            ]
        },
    },
    {
        "match": {"last_role": "human", "last_text_regex": "(?i)bad"},
        "reply": {"tool_calls": [{"name": "get_item", "raw_arguments": "{not json"}]},
    },
    {"match": {"last_role": "tool"}, "reply": {"text": "Done: {{tool_result}}"}},
    {"match": {"purpose": "compaction"}, "reply": {"text": "A summary."}},
    {"reply": {"text": "Hello from the scripted model.", "chunk_chars": 7}},
]


# --------------------------------------------------------------------------- strategies

random_bytes_text = st.binary(max_size=40).map(lambda raw: raw.decode("utf-8", "replace"))
any_text = st.one_of(
    st.text(max_size=40),
    random_bytes_text,
    st.sampled_from(["", " ", "\x00", "list items", "write it", "bad call", "hello"]),
)
message_text = st.one_of(
    any_text,
    any_text.map(lambda t: "list items " + t),
    st.sampled_from(["a" * (32 * 1024), "a" * (32 * 1024 + 1)]),
)
request_id = st.one_of(
    st.just(""),
    st.text(min_size=1, max_size=64),
    random_bytes_text,
    st.text(min_size=65, max_size=80),
    st.sampled_from(["dup-1", "dup-2"]),
)
sequence = st.one_of(
    st.integers(-3, 30),
    st.integers(-(2**63), 2**63 - 1),
)


@dataclass(frozen=True)
class Known:
    """Session ids an example may name: alice's (shared by all examples) and bob's."""

    alice: tuple[str, ...]
    bob: str


def session_ref(known: Known) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from([*known.alice, known.bob, ""]),
        any_text,
    )


def actions(known: Known) -> st.SearchStrategy[list[chat_pb2.ChatRequest]]:
    opens = st.builds(
        lambda rid, sid, project, title, after: chat_pb2.ChatRequest(
            request_id=rid,
            open=chat_pb2.OpenAction(
                session_id=sid, project_id=project, title=title, after_sequence=after
            ),
        ),
        request_id,
        session_ref(known),
        st.one_of(st.just("demo"), st.just(""), any_text),
        any_text,
        sequence,
    )
    sends = st.builds(
        lambda rid, body: chat_pb2.ChatRequest(
            request_id=rid, send_message=chat_pb2.SendMessageAction(text=body)
        ),
        request_id,
        message_text,
    )
    cancels = st.builds(
        lambda rid, turn: chat_pb2.ChatRequest(
            request_id=rid, cancel_turn=chat_pb2.CancelTurnAction(turn_id=turn)
        ),
        request_id,
        st.one_of(st.just(""), any_text),
    )
    empty = st.builds(lambda rid: chat_pb2.ChatRequest(request_id=rid), request_id)
    # Most sequences start with an open of something real, so that later actions reach
    # the turn runner instead of stopping at NOT_OPEN.
    good_open = st.builds(
        lambda sid: chat_pb2.ChatRequest(
            open=chat_pb2.OpenAction(session_id=sid)
            if sid
            else chat_pb2.OpenAction(project_id="demo", title="fuzz")
        ),
        st.sampled_from([*known.alice, ""]),
    )
    return st.one_of(
        st.tuples(good_open, st.lists(st.one_of(sends, cancels, opens, empty), max_size=4)).map(
            lambda pair: [pair[0], *pair[1]]
        ),
        st.lists(st.one_of(opens, sends, cancels, empty), min_size=1, max_size=5),
    )


# --------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    stack: Stack
    planner: Planner
    known: Known


@pytest.fixture
async def rig(tmp_path: Path, pg_url: str) -> AsyncIterator[Rig]:
    """One planner for every example. Hypothesis runs all examples within one test call,
    so this fixture's teardown runs once, after the last: it checks what the examples
    stored (``check_store``) and that the planner still serves (``check_still_serving``).
    A violation there is reported as an error of the test."""
    stack = await start_stack(tmp_path / "data", RULES, database_url=pg_url)
    try:
        planner = await stack.planner("fuzz-replica")
        alice = tuple([await create_session(planner, stack.auth(), f"s{i}") for i in range(3)])
        bob = await create_session(planner, stack.auth("bob"), "bob")
        rig = Rig(stack, planner, Known(alice, bob))
        yield rig
        await check_store(rig)
        await check_still_serving(rig)
    finally:
        await stack.stop()


# Hypothesis draws the examples before the fixture runs, so the strategy needs the ids
# ahead of time: the rig's sessions are found by position through this indirection.
KNOWN = Known(("alice-0", "alice-1", "alice-2"), "bob-0")


def resolve(rig: Rig, request: chat_pb2.ChatRequest) -> chat_pb2.ChatRequest:
    if request.WhichOneof("action") != "open":
        return request
    placeholders = dict(zip(KNOWN.alice, rig.known.alice, strict=True))
    placeholders[KNOWN.bob] = rig.known.bob
    resolved = chat_pb2.ChatRequest()
    resolved.CopyFrom(request)
    resolved.open.session_id = placeholders.get(request.open.session_id, request.open.session_id)
    return resolved


async def run_example(rig: Rig, user: str, requests: list[chat_pb2.ChatRequest]) -> None:
    seen: set[str] = set()
    chat = Chat(rig.planner.stub, rig.stack.auth(user))
    for request in requests:
        await chat.call.write(resolve(rig, request))
    await chat.call.done_writing()

    async def drain() -> grpc.aio.AioRpcError | None:
        while True:
            try:
                response = await chat.call.read()
            except grpc.aio.AioRpcError as error:
                return error
            if response is grpc.aio.EOF:
                return None
            kind = response.WhichOneof("event")
            if kind == "error":
                assert response.error.code not in BUG_CODES, response
                seen.add(f"reply {error_info(response.error).reason}")
            elif kind == "turn_ended":
                info = response.turn_ended.error_info
                assert info.reason != "INTERNAL", response
                name = resources_pb2.TurnEndReason.Name(response.turn_ended.reason)
                seen.add(f"turn {name} {info.reason}".strip())
            elif kind in ("tool_call_finished", "knowledge_written"):
                seen.add(kind)

    try:
        error = await asyncio.wait_for(drain(), STREAM_BOUND_S)
    except TimeoutError:
        chat.cancel()
        raise AssertionError(
            f"the stream did not end within {STREAM_BOUND_S} s: {requests}"
        ) from None
    if error is not None:
        assert error.code().value[0] not in BUG_CODES, (error, requests)
        seen.add(f"stream {error.code().name}")
    # Coverage, shown by --hypothesis-show-statistics.
    for label in sorted(seen):
        event(label)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=False,
)
@given(user=st.sampled_from(["alice", "alice", "alice", "bob"]), requests=actions(KNOWN))
async def test_random_chat_requests_cause_no_crash_hang_or_half_stored_turn(
    rig: Rig, user: str, requests: list[chat_pb2.ChatRequest]
) -> None:
    await run_example(rig, user, requests)


async def check_store(rig: Rig) -> None:
    engine = make_engine(rig.stack.database_url, pool_size=1)
    try:
        async with engine.connect() as conn:

            async def scalar(sql: str) -> int:
                return int((await conn.execute(text(sql))).scalar_one())

            # No turn is left running once its stream has ended (the model answers at
            # once; cancelled turns close at once).
            for _ in range(100):
                if await scalar("SELECT count(*) FROM turns WHERE state = 'running'") == 0:
                    break
                await asyncio.sleep(0.05)
            assert await scalar("SELECT count(*) FROM turns WHERE state = 'running'") == 0
            assert await scalar("SELECT count(*) FROM turns") > 0
            # Every tool call has a result.
            unanswered = await scalar(
                "SELECT count(*) FROM messages c WHERE c.kind = 'tool_call' AND NOT EXISTS ("
                " SELECT 1 FROM messages r WHERE r.session_id = c.session_id"
                " AND r.kind = 'tool_result' AND r.tool_call_id = c.tool_call_id)"
            )
            assert unanswered == 0
            # Every turn has its message_accepted and exactly one turn_ended.
            broken = await scalar(
                "SELECT count(*) FROM turns t WHERE"
                " (SELECT count(*) FROM session_events e WHERE e.turn_id = t.turn_id"
                "  AND e.kind = 'turn_ended') <> 1"
                " OR NOT EXISTS (SELECT 1 FROM session_events e WHERE e.turn_id = t.turn_id"
                "  AND e.kind = 'message_accepted' AND e.sequence = t.human_sequence)"
            )
            assert broken == 0
            # Sequences: 1..last_sequence, no gaps, per session.
            gaps = await scalar(
                "SELECT count(*) FROM sessions s WHERE s.last_sequence <> ("
                " SELECT count(*) FROM session_events e WHERE e.session_id = s.session_id)"
                " OR s.last_sequence <> COALESCE((SELECT max(sequence) FROM session_events e"
                "  WHERE e.session_id = s.session_id), 0)"
            )
            assert gaps == 0
            orphans = await scalar(
                "SELECT count(*) FROM messages m WHERE NOT EXISTS (SELECT 1 FROM"
                " session_events e WHERE e.session_id = m.session_id"
                " AND e.sequence = m.sequence)"
            )
            assert orphans == 0
    finally:
        await engine.dispose()


async def check_still_serving(rig: Rig) -> None:
    health = health_pb2_grpc.HealthStub(rig.planner.channel)
    response = await health.Check(health_pb2.HealthCheckRequest())
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    chat = Chat(rig.planner.stub, rig.stack.auth())
    await chat.open(project_id="demo", title="after the fuzz")
    ended = await chat.turn("list items please", "after-fuzz")
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    await chat.close()
