"""Domain values to ballet.planner.v1 messages."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from ballet.planner.v1 import resources_pb2
from google.rpc import status_pb2

from service.core.model import (
    ChangesetProposedData,
    CompactedData,
    EventKind,
    KnowledgeWrittenData,
    Message,
    MessageKind,
    Session,
    SessionEvent,
    TextDelta,
    Turn,
    TurnEndedData,
    TurnEndReason,
    TurnStartedData,
    TurnState,
    Usage,
)
from service.transport import convert

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def message(kind: MessageKind = MessageKind.HUMAN, **fields: object) -> Message:
    return Message(
        session_id="s",
        turn_id="t",
        message_id="m",
        kind=kind,
        create_time=NOW,
        sequence=3,
        **fields,
    )  # type: ignore[arg-type]


def test_session() -> None:
    session = Session(
        session_id="s",
        project_id="p",
        organization_id="acme",
        owner_id="alice",
        title="T",
        create_time=NOW,
        update_time=NOW + timedelta(seconds=1),
        summary="so far",
        summary_up_to=7,
        last_sequence=9,
        running_turn_id="t",
    )
    proto = convert.session_to_proto(session)
    assert (proto.summary, proto.summary_up_to, proto.last_sequence) == ("so far", 7, 9)
    assert proto.create_time.ToDatetime(tzinfo=UTC) == NOW
    assert proto.update_time.seconds == proto.create_time.seconds + 1
    assert proto.running_turn_id == "t"


def test_message_with_and_without_usage() -> None:
    answer = convert.message_to_proto(
        message(MessageKind.ASSISTANT, text="hi", usage=Usage(5, 2), cut=True)
    )
    assert answer.kind == resources_pb2.MESSAGE_KIND_ASSISTANT
    assert (answer.usage.input_tokens, answer.usage.output_tokens, answer.cut) == (5, 2, True)
    human = convert.message_to_proto(message(text="q"))
    assert not human.HasField("usage")
    tool = convert.message_to_proto(
        message(
            MessageKind.TOOL_RESULT,
            tool_call_id="c",
            tool_name="get_item",
            tool_result="{}",
            tool_error=True,
        )
    )
    assert (tool.tool_call_id, tool.tool_name, tool.tool_error) == ("c", "get_item", True)


def test_naive_datetimes_are_utc() -> None:
    assert convert.timestamp(NOW.replace(tzinfo=None)) == convert.timestamp(NOW)


def test_turn_running_and_failed() -> None:
    running = convert.turn_to_proto(
        Turn(turn_id="t", session_id="s", human_id="alice", state=TurnState.RUNNING, start_time=NOW)
    )
    assert running.state == resources_pb2.TURN_STATE_RUNNING
    assert running.end_reason == resources_pb2.TURN_END_REASON_UNSPECIFIED
    assert not running.HasField("end_time") and not running.HasField("error_info")
    failed = convert.turn_to_proto(
        Turn(
            turn_id="t",
            session_id="s",
            human_id="alice",
            state=TurnState.ENDED,
            start_time=NOW,
            end_time=NOW,
            end_reason=TurnEndReason.FAILED,
            error_reason="MODEL_UNAVAILABLE",
            rounds=2,
            usage=Usage(10, 3),
            model="m",
        )
    )
    assert failed.end_reason == resources_pb2.TURN_END_REASON_FAILED
    assert (failed.error_info.reason, failed.error_info.domain) == (
        "MODEL_UNAVAILABLE",
        "planner.ballet",
    )
    assert (failed.rounds, failed.usage.input_tokens, failed.model) == (2, 10, "m")


@pytest.mark.parametrize(
    ("kind", "payload", "field"),
    [
        (EventKind.MESSAGE_ACCEPTED, message(), "message_accepted"),
        (EventKind.ASSISTANT_MESSAGE, message(MessageKind.ASSISTANT), "assistant_message"),
        (EventKind.TOOL_CALL_STARTED, message(MessageKind.TOOL_CALL), "tool_call_started"),
        (EventKind.TOOL_CALL_FINISHED, message(MessageKind.TOOL_RESULT), "tool_call_finished"),
        (EventKind.TURN_STARTED, TurnStartedData("m", 8), "turn_started"),
        (EventKind.CHANGESET_PROPOSED, ChangesetProposedData("cs1", "c1"), "changeset_proposed"),
        (EventKind.KNOWLEDGE_WRITTEN, KnowledgeWrittenData("k1", 2, "c2"), "knowledge_written"),
        (
            EventKind.TURN_ENDED,
            TurnEndedData(TurnEndReason.MAX_ROUNDS, Usage(1, 2), Usage(3, 4), 8),
            "turn_ended",
        ),
    ],
)
def test_events(kind: EventKind, payload: object, field: str) -> None:
    is_message = isinstance(payload, Message)
    event = SessionEvent(
        session_id="s",
        turn_id="t",
        kind=kind,
        create_time=NOW,
        sequence=3,
        message=payload if is_message else None,  # type: ignore[arg-type]
        data=None if is_message else payload,  # type: ignore[arg-type]
    )
    response = convert.event_to_proto(event)
    assert response.WhichOneof("event") == field
    assert (response.session_id, response.turn_id, response.sequence) == ("s", "t", 3)


def test_turn_ended_and_compacted_details() -> None:
    ended = SessionEvent(
        "s",
        "t",
        EventKind.TURN_ENDED,
        NOW,
        sequence=9,
        data=TurnEndedData(TurnEndReason.FAILED, Usage(), Usage(), 1, "TURN_TIMEOUT", "too slow"),
    )
    proto = convert.event_to_proto(ended).turn_ended
    assert proto.reason == resources_pb2.TURN_END_REASON_FAILED
    assert (proto.error_info.reason, proto.error_message) == ("TURN_TIMEOUT", "too slow")
    marker = message(MessageKind.COMPACTION, up_to=5, estimated_tokens=70_000)
    compacted = SessionEvent(
        "s",
        "t",
        EventKind.COMPACTED,
        NOW,
        sequence=6,
        message=marker,
        data=CompactedData(5, 70_000),
    )
    proto_c = convert.event_to_proto(compacted).compacted
    assert (proto_c.up_to, proto_c.estimated_tokens, proto_c.message.kind) == (
        5,
        70_000,
        resources_pb2.MESSAGE_KIND_COMPACTION,
    )
    with pytest.raises(ValueError):
        convert.event_to_proto(SessionEvent("s", "t", EventKind.ASSISTANT_MESSAGE, NOW))


def test_replies_have_sequence_zero() -> None:
    delta = convert.text_delta_to_proto(TextDelta("s", "t", "m", 12, "abc"))
    assert (delta.sequence, delta.text_delta.offset, delta.text_delta.message_id) == (0, 12, "m")
    error = convert.error_response(status_pb2.Status(code=5, message="x"), request_id="r1")
    assert (error.sequence, error.request_id, error.error.code) == (0, "r1", 5)


def test_encoded_size_bounds_the_response() -> None:
    big = message(text="x" * 1000)
    assert convert.encoded_message_bytes(big) >= convert.message_to_proto(big).ByteSize()
