"""Builders of domain values for the store's integration tests.

Every value is built from a few names so a test reads as its scenario: a session ``s1``
of ``alice`` in project ``p1``, a turn ``t1`` started by request ``r1`` ...
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from service.core.model import (
    ChangesetProposedData,
    CompactedData,
    EventKind,
    KnowledgeWrittenData,
    Message,
    MessageKind,
    MessageQueuedData,
    OnBusy,
    SessionEvent,
    Turn,
    TurnEndedData,
    TurnEndReason,
    TurnStartedData,
    TurnState,
    Usage,
)
from service.core.ports import (
    Enqueue,
    NewSession,
    Promotion,
    RunningLimits,
    TurnCommit,
    TurnPatch,
    TurnStart,
)

#: The tests' fixed clock: leases are compared with it, never with the wall clock.
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
LEASE = timedelta(seconds=15)
REPLICA = "replica-a"

_ids = itertools.count(1)


def unique(prefix: str) -> str:
    """A fresh id such as ``m17``."""
    return f"{prefix}{next(_ids)}"


def new_session(
    session_id: str = "s1",
    *,
    owner: str = "alice",
    project: str = "p1",
    organization: str = "acme",
    title: str = "Planning",
    request_id: str = "",
    request_hash: str = "",
    now: datetime = T0,
) -> NewSession:
    """A ``NewSession`` of ``owner`` in ``project``."""
    return NewSession(
        session_id=session_id,
        project_id=project,
        organization_id=organization,
        owner_id=owner,
        title=title,
        request_id=request_id,
        request_hash=request_hash,
        now=now,
    )


def message(
    session_id: str,
    turn_id: str,
    kind: MessageKind,
    *,
    now: datetime = T0,
    **fields: Any,
) -> Message:
    """A message of ``kind`` with a fresh id; ``fields`` set the rest."""
    return Message(
        session_id=session_id,
        turn_id=turn_id,
        message_id=unique("m"),
        kind=kind,
        create_time=now,
        **fields,
    )


def turn_start(
    session_id: str = "s1",
    turn_id: str = "t1",
    *,
    human: str = "alice",
    project: str = "p1",
    request_id: str | None = None,
    request_hash: str = "hash-1",
    text: str = "What is runnable?",
    owner: str = REPLICA,
    now: datetime = T0,
    lease: timedelta = LEASE,
    limits: RunningLimits | None = None,
) -> TurnStart:
    """Step 1 of a turn: the human message, ``message_accepted`` and ``turn_started``."""
    human_message = message(session_id, turn_id, MessageKind.HUMAN, text=text, human_id=human)
    turn = Turn(
        turn_id=turn_id,
        session_id=session_id,
        human_id=human,
        state=TurnState.RUNNING,
        start_time=now,
        request_id=request_id if request_id is not None else f"req-{turn_id}",
        request_hash=request_hash,
        model="scripted",
        owner=owner,
        lease_expires_at=now + lease,
    )
    events = [
        SessionEvent(session_id, turn_id, EventKind.MESSAGE_ACCEPTED, now, message=human_message),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.TURN_STARTED,
            now,
            data=TurnStartedData(model="scripted", max_rounds=8),
        ),
    ]
    return TurnStart(
        turn=turn,
        project_id=project,
        message=human_message,
        events=events,
        limits=limits or RunningLimits(),
        now=now,
    )


def queued_start(
    session_id: str = "s1",
    turn_id: str = "q1",
    *,
    on_busy: OnBusy = OnBusy.ENQUEUE,
    max_queued: int = 10,
    token: str = "alice-token",
    text: str | None = None,
    request_hash: str | None = None,
    now: datetime = T0,
) -> TurnStart:
    """``turn_start`` that queues behind a running turn (decision 0300)."""
    text = text if text is not None else f"and then {turn_id}?"
    start = turn_start(
        session_id,
        turn_id,
        text=text,
        request_hash=request_hash or f"hash-{turn_id}",
        now=now,
    )
    event = SessionEvent(
        session_id,
        turn_id,
        EventKind.MESSAGE_QUEUED,
        now,
        data=MessageQueuedData(text, "", on_busy, "alice"),
    )
    return TurnStart(
        turn=start.turn,
        project_id=start.project_id,
        message=start.message,
        events=start.events,
        limits=start.limits,
        now=now,
        enqueue=Enqueue(on_busy, max_queued, token, event),
    )


def promotion(owner: str = "replica-b", *, now: datetime = T0) -> Promotion:
    """Start the next queued turn on ``owner`` under a lease from ``now``."""
    return Promotion(owner, now + LEASE, "scripted", 8)


def tool_round_events(
    session_id: str, turn_id: str, *, call_id: str | None = None, now: datetime = T0
) -> list[SessionEvent]:
    """An assistant message with one tool call, the call and its result."""
    call_id = call_id or unique("call")
    return [
        SessionEvent(
            session_id,
            turn_id,
            EventKind.ASSISTANT_MESSAGE,
            now,
            message=message(
                session_id,
                turn_id,
                MessageKind.ASSISTANT,
                text="Let me look.",
                usage=Usage(1200, 40),
                human_id="alice",
            ),
        ),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.TOOL_CALL_STARTED,
            now,
            message=message(
                session_id,
                turn_id,
                MessageKind.TOOL_CALL,
                tool_call_id=call_id,
                tool_name="list_runnable",
                tool_arguments='{"limit": 5}',
                human_id="alice",
            ),
        ),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.TOOL_CALL_FINISHED,
            now,
            message=message(
                session_id,
                turn_id,
                MessageKind.TOOL_RESULT,
                tool_call_id=call_id,
                tool_name="list_runnable",
                tool_result='{"items": [{"id": "T-1", "title": "Ünïcode ✓"}]}',
                human_id="alice",
            ),
        ),
    ]


def every_other_event(session_id: str, turn_id: str, *, now: datetime = T0) -> list[SessionEvent]:
    """One event of every kind ``tool_round_events`` and ``turn_start`` do not make."""
    return [
        SessionEvent(
            session_id,
            turn_id,
            EventKind.CHANGESET_PROPOSED,
            now,
            data=ChangesetProposedData(changeset_id="cs-1", tool_call_id="call-w1"),
        ),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.KNOWLEDGE_WRITTEN,
            now,
            data=KnowledgeWrittenData(entry_id="k-1", version=3, tool_call_id="call-w2"),
        ),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.COMPACTED,
            now,
            message=message(
                session_id,
                turn_id,
                MessageKind.COMPACTION,
                text="Summary: alice asked what is runnable.",
                up_to=4,
                estimated_tokens=9000,
            ),
            data=CompactedData(up_to=4, estimated_tokens=9000),
        ),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.ASSISTANT_MESSAGE,
            now,
            message=message(
                session_id,
                turn_id,
                MessageKind.ASSISTANT,
                text="Partial answ",
                cut=True,
                human_id="alice",
            ),
        ),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.TOOL_CALL_FINISHED,
            now,
            message=message(
                session_id,
                turn_id,
                MessageKind.TOOL_RESULT,
                tool_call_id="call-x",
                tool_name="get_item",
                tool_result='{"error": {"reason": "NOT_FOUND", "message": "no T-9"}}',
                tool_error=True,
                human_id="alice",
            ),
        ),
    ]


def turn_ended(
    session_id: str,
    turn_id: str,
    reason: TurnEndReason = TurnEndReason.COMPLETED,
    *,
    now: datetime = T0,
    error_reason: str = "",
) -> SessionEvent:
    """A ``turn_ended`` event."""
    return SessionEvent(
        session_id,
        turn_id,
        EventKind.TURN_ENDED,
        now,
        data=TurnEndedData(
            reason=reason,
            usage=Usage(2400, 90),
            compaction_usage=Usage(0, 0),
            rounds=1,
            error_reason=error_reason,
            error_message="the model failed" if error_reason else "",
        ),
    )


def end_commit(
    session_id: str,
    turn_id: str,
    reason: TurnEndReason = TurnEndReason.COMPLETED,
    *,
    now: datetime = T0,
    owner: str | None = REPLICA,
    lease_expired_before: datetime | None = None,
    events: Sequence[SessionEvent] = (),
) -> TurnCommit:
    """The commit that ends a turn with ``reason`` (``events`` come before turn_ended)."""
    return TurnCommit(
        session_id=session_id,
        turn_id=turn_id,
        now=now,
        events=[*events, turn_ended(session_id, turn_id, reason, now=now)],
        turn_patch=TurnPatch(
            rounds=1, usage=Usage(2400, 90), compaction_usage=Usage(0, 0), end_reason=reason
        ),
        owner=owner,
        lease_expired_before=lease_expired_before,
    )
