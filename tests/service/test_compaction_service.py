"""Context compaction over real gRPC on the devstack.

docs/spec/compaction.md; decision 0060 (the edge cases). The policy
itself (thresholds, the second compaction, never separating a call from its result) is
pinned by ``tests/unit/test_turn.py`` with fakes; here the same loop runs behind the
planner's gRPC API, with the scripted model reporting the usage each test needs, and the
tests read what the planner stored (``ListMessages``, ``GetSession``, ``GetTurn``),
streamed, logged and exported (``/metrics``), and what the model was sent.

Settings of the module's planner: ``compact_at_tokens`` 1,000, ``compaction_input_max_
tokens`` 4,096 (about 11 KiB of transcript per compaction call once the instructions and
room for the summary are set aside), ``max_rounds`` 3, model first-delta deadline 1 s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ballet.llm.v1 import gateway_pb2
from ballet.planner.v1 import resources_pb2
from sqlalchemy import insert, update

from devstack.gateway.base import Provider, ProviderChunk
from service.adapters.store import codec, tables
from service.core.compaction import compaction_request_tokens
from service.core.context import SUMMARY_TAG
from service.core.estimate import MESSAGE_OVERHEAD_TOKENS, text_tokens
from service.core.model import (
    ContextEstimate,
    EventKind,
    Message,
    MessageKind,
    SessionEvent,
    Turn,
    TurnEndReason,
    TurnState,
)
from service.core.ports import RunningLimits, SummaryUpdate, TurnCommit, TurnPatch, TurnStart
from tests.pg import PgServer
from tests.service.turn_support import QUIET_UPKEEP, Rig, events, reset, start_rig, stop_rig

COMPACT_AT = 1000
INPUT_MAX = 4096
SETTINGS = {
    "PLANNER__COMPACT_AT_TOKENS": str(COMPACT_AT),
    "PLANNER__COMPACTION_INPUT_MAX_TOKENS": str(INPUT_MAX),
    "PLANNER__MAX_ROUNDS": "3",
    "DEPENDENCIES__MODEL_FIRST_DELTA_S": "1",
}
COMPACTION = gateway_pb2.PURPOSE_COMPACTION
KIND = resources_pb2.MessageKind
END = resources_pb2.TurnEndReason
#: Padding that makes a summary plausible for a long history (decision 0170).
LONG_SUMMARY = (
    "They want to know what the demo project holds and what to work on next. The "
    "planner listed the skills and the runnable tickets of the pantry epics, found no "
    "blocker that is still open, and proposed nothing yet; nothing waits for a decision."
)
SUMMARY_RULE: dict[str, Any] = {
    "match": {"purpose": "compaction"},
    "reply": {"text": "SUMMARY: the human asked things", "usage": {"input_tokens": 900,
                                                                    "output_tokens": 20}},
}  # fmt: skip


@pytest.fixture(scope="module")
async def module_rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    started = await start_rig(tmp_path_factory.mktemp("compaction"), settings=SETTINGS)
    yield started
    await stop_rig(started)


@pytest.fixture
def rig(module_rig: Rig) -> Iterator[Rig]:
    reset(module_rig)
    yield module_rig
    module_rig.gateway.provider = module_rig.provider
    reset(module_rig)


def answer(text: str, input_tokens: int, output_tokens: int = 10, **match: Any) -> dict[str, Any]:
    """A turn rule answering ``text`` and reporting that usage."""
    return {
        "match": {"purpose": "turn", **match},
        "reply": {
            "text": text,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        },
    }


async def compactions_total(rig: Rig) -> float:
    """``ballet_planner_compactions_total`` as a scrape of /metrics shows it."""
    url = f"http://{rig.app.metrics_address}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    found = re.search(r"^ballet_planner_compactions_total (\S+)$", body, re.M)
    return float(found.group(1)) if found else 0.0


def human_texts(request: gateway_pb2.GenerateRequest) -> list[str]:
    return [m.text for m in request.messages if m.role == gateway_pb2.ROLE_USER]


def summary_block(summary: str) -> str:
    """The summary as the model gets it: system-side, delimited (decision 0172)."""
    return f"<{SUMMARY_TAG}>\n{summary}\n</{SUMMARY_TAG}>"


# ---------------------------------------------------------------------------------------


async def test_a_compaction_is_stored_streamed_and_counted(rig: Rig) -> None:
    rig.scenario(
        [SUMMARY_RULE, answer("first answer", 2000, last_text_regex="^first"),
         answer("second answer", 300)]
    )  # fmt: skip
    session_id, _ = await rig.run_turn("first question")
    before = await compactions_total(rig)
    _, received = await rig.run_turn("second question", session_id=session_id)

    # Estimate: the usage the first answer reported, plus the new human message.
    estimated = 2000 + 10 + MESSAGE_OVERHEAD_TOKENS + text_tokens("second question")
    (compacted,) = events(received, "compacted")
    transcript = await rig.transcript(session_id)
    first_answer = next(m for m in transcript if m.text == "first answer")
    assert (compacted.compacted.up_to, compacted.compacted.estimated_tokens) == (
        first_answer.sequence,
        estimated,
    )
    (marker,) = [m for m in transcript if m.kind == KIND.MESSAGE_KIND_COMPACTION]
    assert (marker.up_to, marker.estimated_tokens) == (first_answer.sequence, estimated)
    assert marker == compacted.compacted.message
    assert [m.text for m in transcript if m.kind == KIND.MESSAGE_KIND_HUMAN] == [
        "first question",
        "second question",
    ], "the transcript stays complete"
    session = await rig.get_session(session_id)
    assert (session.summary, session.summary_up_to) == (
        "SUMMARY: the human asked things",
        first_answer.sequence,
    )
    (summarized,) = rig.requests(COMPACTION)
    assert "Human: first question" in summarized.system_prompt
    assert "second question" not in summarized.system_prompt, "the current turn stays"
    assert not summarized.tools
    _, after = rig.requests()
    assert human_texts(after) == ["second question"]
    assert summary_block("SUMMARY: the human asked things") in after.system_context
    turn = await rig.get_turn(session_id, compacted.turn_id)
    assert (turn.compaction_usage.input_tokens, turn.compaction_usage.output_tokens) == (900, 20)
    assert (turn.usage.input_tokens, turn.usage.output_tokens) == (300, 10)
    assert await compactions_total(rig) == before + 1


# ---------------------------------------------------------------------------------------

FAILURES = [
    pytest.param({"text": "too late", "delay_ms": 3000}, "MODEL_TIMEOUT", id="timeout"),
    pytest.param({"error": {"code": "INTERNAL", "message": "boom"}}, "", id="error"),
    pytest.param({"text": "   "}, "", id="empty-summary"),
]


@pytest.mark.parametrize(("reply", "reason"), FAILURES)
async def test_a_failed_compaction_changes_nothing_and_the_turn_completes(
    rig: Rig, caplog: pytest.LogCaptureFixture, reply: dict[str, Any], reason: str
) -> None:
    rig.scenario(
        [{"match": {"purpose": "compaction"}, "reply": reply},
         answer("first answer", 2000, last_text_regex="^first"), answer("second answer", 300)]
    )  # fmt: skip
    session_id, _ = await rig.run_turn("first question")
    before = await rig.transcript(session_id)
    counted = await compactions_total(rig)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.core.turn"):
        _, received = await rig.run_turn("second question", session_id=session_id)

    assert events(received, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
    assert not events(received, "compacted")
    assert len(rig.requests(COMPACTION)) == 1, "no second try in the same turn"
    warnings = [r for r in caplog.records if "compaction" in r.getMessage()]
    assert warnings and all(r.levelno == logging.WARNING for r in warnings)
    assert reason in warnings[0].getMessage()
    session = await rig.get_session(session_id)
    assert (session.summary, session.summary_up_to) == ("", 0)
    after = await rig.transcript(session_id)
    assert after[: len(before)] == before
    assert not [m for m in after if m.kind == KIND.MESSAGE_KIND_COMPACTION]
    (_, uncompacted) = rig.requests()
    assert human_texts(uncompacted) == ["first question", "second question"]
    assert await compactions_total(rig) == counted


# ---------------------------------------------------------------------------------------


async def test_only_the_current_message_is_never_compacted_and_max_rounds_bounds_it(
    rig: Rig,
) -> None:
    """Decision 0060, case 1: the current turn alone is over the threshold."""
    rig.scenario(
        [SUMMARY_RULE,
         {"match": {"purpose": "turn"}, "reply": {
             "tool_calls": [{"name": "list_items", "arguments": {}}],
             "usage": {"input_tokens": 50 * COMPACT_AT, "output_tokens": 10}}}]
    )  # fmt: skip
    session_id, received = await rig.run_turn("x" * 30_000)

    ended = events(received, "turn_ended")[0].turn_ended
    assert (ended.reason, ended.rounds) == (END.TURN_END_REASON_MAX_ROUNDS, 3)
    assert len(rig.requests()) == 3
    assert not rig.requests(COMPACTION), "nothing before the current message to summarize"
    assert (await rig.get_session(session_id)).summary_up_to == 0


async def test_a_history_many_times_the_threshold_is_folded_in_one_compaction(
    rig: Rig,
) -> None:
    """Decision 0060, case 2. Ten answers of 6 KB each report almost no usage, so no turn
    compacts; then an answer reports a large usage, and before the next model call
    everything before the current message (about 15 times the threshold) is folded in
    chunks, as one compaction. The summary plus the current turn still exceed the
    threshold: the turn goes on, and compacts nothing more, since ``up_to`` cannot move
    into the current turn; the next turn compacts again."""
    filler = "x" * 6000
    # Long enough to stand for about 14,000 tokens (decision 0170: at least 50 tokens).
    long_summary = "SUMMARY: the human asked things. " + LONG_SUMMARY
    rig.scenario(
        [
            {**SUMMARY_RULE, "reply": {"text": long_summary,
                                       "usage": {"input_tokens": 3000, "output_tokens": 1500}}},
            {"match": {"purpose": "turn", "last_text_regex": r"^fill (?P<n>\d+)"},
             "reply": {"text": f"FILL-{{{{match:n}}}} {filler}",
                       "usage": {"input_tokens": 1, "output_tokens": 1}}},
            {"match": {"purpose": "turn", "last_role": "human", "last_text_regex": "^heavy"},
             "reply": {"tool_calls": [{"name": "list_skills", "arguments": {}}],
                       "usage": {"input_tokens": 1600, "output_tokens": 10}}},
            {"match": {"purpose": "turn", "tool_name": "list_skills"},
             "reply": {"tool_calls": [{"name": "list_runnable", "arguments": {}}],
                       "usage": {"input_tokens": 1700, "output_tokens": 10}}},
            answer("heavy done", 1800, tool_name="list_runnable"),
            answer("next done", 100),
        ]
    )  # fmt: skip
    session_id = (await rig.create_session()).session_id
    for n in range(10):
        await rig.run_turn(f"fill {n}", session_id=session_id)
    assert not rig.requests(COMPACTION)
    counted = await compactions_total(rig)
    rig.gateway.reset()

    _, heavy = await rig.run_turn("heavy question", session_id=session_id)
    assert events(heavy, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
    (compacted,) = events(heavy, "compacted")
    assert compacted.compacted.estimated_tokens > COMPACT_AT
    purposes = [r.purpose for r in rig.gateway.requests]
    chunks = [r.system_prompt for r in rig.requests(COMPACTION)]
    assert purposes == [gateway_pb2.PURPOSE_TURN, *[COMPACTION] * len(chunks),
                        gateway_pb2.PURPOSE_TURN, gateway_pb2.PURPOSE_TURN]  # fmt: skip
    assert len(chunks) >= 5, "about 60 KB of history in chunks of about 11 KB"
    assert "<earlier_summary>\n(none)\n</earlier_summary>" in chunks[0]
    for chunk in chunks[1:]:
        assert f"<earlier_summary>\n{long_summary.strip()}\n</earlier_summary>" in chunk
    assert all(compaction_request_tokens(c) <= INPUT_MAX for c in chunks)
    folded = [int(n) for c in chunks for n in re.findall(r"FILL-(\d+)", c)]
    assert folded == list(range(10)), "oldest first, each answer once"
    assert "heavy question" not in "".join(chunks), "the current turn is never summarized"
    assert await compactions_total(rig) == counted + 1
    for request in rig.requests()[1:]:
        assert human_texts(request) == ["heavy question"]
        assert summary_block(long_summary.strip()) in request.system_context
        results = [m.tool_result.tool_call_id for m in request.messages if m.role == 3]
        calls = [c.id for m in request.messages for c in m.tool_calls]
        assert calls == results, "the current turn's calls and results are sent whole"
    first_up_to = compacted.compacted.up_to
    transcript = await rig.transcript(session_id)
    heavy_human = next(m for m in transcript if m.text == "heavy question")
    assert first_up_to == max(m.sequence for m in transcript if m.sequence < heavy_human.sequence)

    rig.gateway.reset()
    _, following = await rig.run_turn("next question", session_id=session_id)
    (again,) = events(following, "compacted")
    assert again.compacted.up_to > first_up_to, "up_to moved over the heavy turn"
    (summarized,) = rig.requests(COMPACTION)
    assert f"<earlier_summary>\n{long_summary.strip()}" in summarized.system_prompt
    assert "Tool call list_skills" in summarized.system_prompt
    assert "Tool result list_runnable" in summarized.system_prompt
    (request,) = rig.requests()
    assert human_texts(request) == ["next question"]
    session = await rig.get_session(session_id)
    assert session.summary_up_to == again.compacted.up_to
    # The transcript stays complete: 10 x (human, answer); heavy: human, call, result,
    # marker, call, result, answer; next: human, marker, answer.
    assert len(await rig.transcript(session_id)) == 10 * 2 + 7 + 3


# ---------------------------------------------------------------------------------------


@dataclass
class _Rows:
    rowcount: int


class RowCounter:
    """Rows the planner's reads returned (its units of work's functions left out),
    snapshotted at each model request."""

    def __init__(self, rig: Rig) -> None:
        self.rows = 0
        self.statements = 0
        self.at_model_calls: list[tuple[int, int]] = []

        def after(_conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            # The health monitor's ``SELECT 1`` runs on its own clock, not the turn's.
            if statement.strip().upper() == "SELECT 1":
                return
            # A unit of work's function is a write, not a read, and may run while the
            # next model call opens (decisions 0380, 0391): which side of the request
            # its returned row falls on is a race, not a cost of the transcript.
            if statement.lstrip().upper().startswith("SELECT PLANNER_"):
                return
            if statement.lstrip().upper().startswith("SELECT"):
                self.statements += 1
                # psycopg reports the rows a SELECT returned (PostgreSQL only).
                self.rows += max(int(cursor.rowcount), 0)

        rig.listen("after_cursor_execute", after)
        # The PostgreSQL hot path (decision 0113) goes around SQLAlchemy: count it too.
        rig.observe_statements(lambda statement, rows: after(None, _Rows(rows), statement))

    def snapshot(self) -> None:
        self.at_model_calls.append((self.rows, self.statements))

    def per_call(self) -> list[tuple[int, int]]:
        """(rows, SELECTs) since the previous model call, for each model call."""
        out: list[tuple[int, int]] = []
        previous = (0, 0)
        for rows, statements in self.at_model_calls:
            out.append((rows - previous[0], statements - previous[1]))
            previous = (rows, statements)
        return out


class CountingProvider:
    """The scripted provider, telling the row counter when each model request arrives."""

    def __init__(self, inner: Provider, counter: RowCounter) -> None:
        self._inner = inner
        self._counter = counter

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        self._counter.snapshot()
        async for chunk in self._inner.generate(request):
            yield chunk


@pytest.fixture
async def pg_rig(tmp_path: Path, pg_cluster: PgServer) -> AsyncIterator[Rig]:
    name = f"compaction_{uuid.uuid4().hex[:12]}"
    pg_cluster.create_database(name)
    started = await start_rig(
        tmp_path / "stack", database_url=pg_cluster.url(name), settings=QUIET_UPKEEP
    )
    try:
        yield started
    finally:
        await stop_rig(started)
        pg_cluster.drop_database(name)


async def seed(rig: Rig, session_id: str, count: int, keep: int) -> None:
    """Store ``count`` messages in one ended turn of a session, with a summary covering
    all but the last ``keep``: the turn through the planner's store, the bulk of its
    answers with one executemany (the store's multi-row INSERT is slow to compile at
    this size, and only the rows matter here)."""
    store: Any = rig.app.store
    now = datetime.now(UTC)
    turn_id = f"turn_seed_{uuid.uuid4().hex}"

    def message(kind: MessageKind, text: str, sequence: int = 0) -> Message:
        return Message(session_id, turn_id, f"msg_{uuid.uuid4().hex}", kind, now,
                       sequence=sequence, text=text, human_id="alice")  # fmt: skip

    human = message(MessageKind.HUMAN, "seeded question")
    started = await store.start_turn(
        TurnStart(
            turn=Turn(turn_id, session_id, "alice", TurnState.RUNNING, now,
                      request_id=turn_id, request_hash="seed", owner="seeder",
                      lease_expires_at=now + timedelta(minutes=5)),
            project_id=rig.project_id,
            message=human,
            events=[SessionEvent(session_id, turn_id, EventKind.MESSAGE_ACCEPTED, now,
                                 message=human)],
            limits=RunningLimits(),
            now=now,
        )
    )  # fmt: skip
    first = started.events[-1].sequence + 1
    answers = [
        SessionEvent(session_id, turn_id, EventKind.ASSISTANT_MESSAGE, now, sequence=first + i,
                     message=message(MessageKind.ASSISTANT, f"seeded answer {i}", first + i))
        for i in range(count - 1)
    ]  # fmt: skip
    async with rig.engine.begin() as conn:
        rows = [codec.message_row(e.message) for e in answers if e.message is not None]
        await conn.execute(insert(tables.messages), rows)
        await conn.execute(insert(tables.session_events), [codec.event_row(e) for e in answers])
        await conn.execute(
            update(tables.sessions)
            .where(tables.sessions.c.session_id == session_id)
            .values(last_sequence=answers[-1].sequence)
        )
    await store.commit(
        TurnCommit(
            session_id, turn_id, now,
            turn_patch=TurnPatch(end_reason=TurnEndReason.COMPLETED),
            summary=SummaryUpdate("SUMMARY of the seeded turn", up_to=count - keep),
            context=ContextEstimate(base_tokens=100, pending_tokens=0),
        )
    )  # fmt: skip


@pytest.mark.postgres
async def test_what_a_turn_reads_does_not_grow_with_the_transcript(pg_rig: Rig) -> None:
    """docs/spec/compaction.md and docs/performance.md (T3): the estimate is a running total and the
    context is read from the summary's ``up_to`` on, so a turn on 5,000 stored messages reads
    exactly as many rows per model call as one on 100."""
    rig = pg_rig
    rig.scenario(
        [{"match": {"last_role": "human"},
          "reply": {"tool_calls": [{"name": "list_items", "arguments": {}}]}},
         {"reply": {"text": "done"}}]
    )  # fmt: skip
    await rig.run_turn("warm the caches")
    measured: dict[int, list[tuple[int, int]]] = {}
    for count in (100, 5000):
        session_id = (await rig.create_session()).session_id
        await seed(rig, session_id, count, keep=5)
        counter = RowCounter(rig)
        rig.gateway.provider = CountingProvider(rig.provider, counter)
        _, received = await rig.run_turn("what now?", session_id=session_id)
        rig.remove_listeners()
        assert events(received, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
        assert len(rig.requests()) >= 2
        assert summary_block("SUMMARY of the seeded turn") in rig.requests()[-1].system_context
        measured[count] = counter.per_call()
        rig.gateway.reset()
    assert measured[100] == measured[5000], measured
    rows_first_call = measured[5000][0][0]
    assert 0 < rows_first_call < 20, measured
    assert not math.isnan(rows_first_call)
