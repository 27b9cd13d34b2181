"""Domain values to ``ballet.planner.v1`` messages (docs/contributing.md servicers stay thin).

Sessions, messages, turns, usage, stored session events and text deltas become the proto
resources and ``ChatResponse`` events of docs/spec/api-and-streams.md. Domain datetimes are timezone
aware; naive ones are taken as UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TypeVar, assert_never

from ballet.planner.v1 import chat_pb2, resources_pb2
from google.protobuf import timestamp_pb2
from google.rpc import error_details_pb2, status_pb2

from service.core.errors import ERROR_DOMAIN, InvalidArgument
from service.core.model import (
    ChangesetProposedData,
    CompactedData,
    EventKind,
    KnowledgeWrittenData,
    Message,
    MessageKind,
    MessageQueuedData,
    OnBusy,
    Session,
    SessionEvent,
    TextDelta,
    ToolCallProgress,
    Turn,
    TurnEndedData,
    TurnEndReason,
    TurnStartedData,
    TurnState,
    Usage,
)

_T = TypeVar("_T")

MESSAGE_KINDS: dict[MessageKind, resources_pb2.MessageKind.ValueType] = {
    MessageKind.HUMAN: resources_pb2.MESSAGE_KIND_HUMAN,
    MessageKind.ASSISTANT: resources_pb2.MESSAGE_KIND_ASSISTANT,
    MessageKind.TOOL_CALL: resources_pb2.MESSAGE_KIND_TOOL_CALL,
    MessageKind.TOOL_RESULT: resources_pb2.MESSAGE_KIND_TOOL_RESULT,
    MessageKind.COMPACTION: resources_pb2.MESSAGE_KIND_COMPACTION,
}
TURN_STATES: dict[TurnState, resources_pb2.TurnState.ValueType] = {
    TurnState.RUNNING: resources_pb2.TURN_STATE_RUNNING,
    TurnState.ENDED: resources_pb2.TURN_STATE_ENDED,
    TurnState.QUEUED: resources_pb2.TURN_STATE_QUEUED,
}
ON_BUSY: dict[resources_pb2.OnBusy.ValueType, OnBusy] = {
    resources_pb2.ON_BUSY_UNSPECIFIED: OnBusy.REJECT,
    resources_pb2.ON_BUSY_REJECT: OnBusy.REJECT,
    resources_pb2.ON_BUSY_ENQUEUE: OnBusy.ENQUEUE,
    resources_pb2.ON_BUSY_INTERRUPT: OnBusy.INTERRUPT,
    resources_pb2.ON_BUSY_JOIN: OnBusy.JOIN,
}
ON_BUSY_TO_PROTO: dict[OnBusy, resources_pb2.OnBusy.ValueType] = {
    OnBusy.REJECT: resources_pb2.ON_BUSY_REJECT,
    OnBusy.ENQUEUE: resources_pb2.ON_BUSY_ENQUEUE,
    OnBusy.INTERRUPT: resources_pb2.ON_BUSY_INTERRUPT,
    OnBusy.JOIN: resources_pb2.ON_BUSY_JOIN,
}
END_REASONS: dict[TurnEndReason, resources_pb2.TurnEndReason.ValueType] = {
    TurnEndReason.COMPLETED: resources_pb2.TURN_END_REASON_COMPLETED,
    TurnEndReason.MAX_ROUNDS: resources_pb2.TURN_END_REASON_MAX_ROUNDS,
    TurnEndReason.CANCELLED: resources_pb2.TURN_END_REASON_CANCELLED,
    TurnEndReason.FAILED: resources_pb2.TURN_END_REASON_FAILED,
    TurnEndReason.INTERRUPTED: resources_pb2.TURN_END_REASON_INTERRUPTED,
    TurnEndReason.INTERRUPTED_BY_MESSAGE: resources_pb2.TURN_END_REASON_INTERRUPTED_BY_MESSAGE,
    TurnEndReason.JOINED: resources_pb2.TURN_END_REASON_JOINED,
    TurnEndReason.OUTPUT_LIMIT: resources_pb2.TURN_END_REASON_OUTPUT_LIMIT,
    TurnEndReason.BUDGET_EXHAUSTED: resources_pb2.TURN_END_REASON_BUDGET_EXHAUSTED,
}


def on_busy_from_proto(value: resources_pb2.OnBusy.ValueType) -> OnBusy:
    """The ``on_busy`` of a send; a value this planner does not know is
    ``InvalidArgument``/``UNKNOWN_ON_BUSY`` (AIP-126: never guess)."""
    found = ON_BUSY.get(value)
    if found is None:
        raise InvalidArgument(f"on_busy {value} is not known", reason="UNKNOWN_ON_BUSY")
    return found


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    """A protobuf ``Timestamp`` of ``value`` (naive datetimes are UTC), to the
    microsecond. The same value as ``Timestamp.FromDatetime``, from the offset to the
    epoch in whole days, seconds and microseconds (exact, and without its calendar
    arithmetic: every Chat event carries one or two of these)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    since = value - _EPOCH
    return timestamp_pb2.Timestamp(
        seconds=since.days * 86_400 + since.seconds, nanos=since.microseconds * 1000
    )


def usage_to_proto(usage: Usage) -> resources_pb2.Usage:
    """``Usage`` in tokens."""
    return resources_pb2.Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)


def error_info(reason: str) -> error_details_pb2.ErrorInfo:
    """An ``ErrorInfo`` of domain ``planner.ballet`` (AIP-193)."""
    return error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)


def session_to_proto(session: Session) -> resources_pb2.Session:
    """``Session`` with its summary, ``summary_up_to`` and ``last_sequence``."""
    return resources_pb2.Session(
        session_id=session.session_id,
        project_id=session.project_id,
        organization_id=session.organization_id,
        owner_id=session.owner_id,
        title=session.title,
        create_time=timestamp(session.create_time),
        update_time=timestamp(session.update_time),
        summary=session.summary,
        summary_up_to=session.summary_up_to,
        last_sequence=session.last_sequence,
        running_turn_id=session.running_turn_id,
    )


def message_to_proto(message: Message) -> resources_pb2.Message:
    """A transcript ``Message``; ``usage`` only when the provider reported it."""
    result = resources_pb2.Message(
        session_id=message.session_id,
        sequence=message.sequence,
        message_id=message.message_id,
        turn_id=message.turn_id,
        kind=MESSAGE_KINDS[message.kind],
        cut=message.cut,
        text=message.text,
        tool_call_id=message.tool_call_id,
        tool_name=message.tool_name,
        tool_arguments=message.tool_arguments,
        tool_result=message.tool_result,
        tool_error=message.tool_error,
        human_id=message.human_id,
        create_time=timestamp(message.create_time),
        up_to=message.up_to,
        estimated_tokens=message.estimated_tokens,
        finish_reason=message.finish_reason,
        served_model=message.served_model,
        provider_tool_call_id=message.provider_call_id,
        truncated=message.truncated,
        original_bytes=message.original_bytes,
    )
    if message.usage is not None:
        result.usage.CopyFrom(usage_to_proto(message.usage))
    return result


def turn_to_proto(turn: Turn) -> resources_pb2.Turn:
    """A ``Turn``: state, end reason (with ``ErrorInfo`` when failed), rounds, usage,
    versions. Lease and cancel bookkeeping stay inside the planner."""
    result = resources_pb2.Turn(
        session_id=turn.session_id,
        turn_id=turn.turn_id,
        state=TURN_STATES[turn.state],
        rounds=turn.rounds,
        usage=usage_to_proto(turn.usage),
        compaction_usage=usage_to_proto(turn.compaction_usage),
        instructions_version=turn.instructions_version,
        tool_schema_version=turn.tool_schema_version,
        skill_name=turn.skill_name,
        skill_version=turn.skill_version,
        model=turn.model,
        human_sequence=turn.human_sequence,
        start_time=timestamp(turn.start_time),
        request_id=turn.request_id,
        behind_turn_id=turn.behind_turn_id,
        queued_text=turn.queued_text,
    )
    if turn.end_reason is not None:
        result.end_reason = END_REASONS[turn.end_reason]
    if turn.error_reason:
        result.error_info.CopyFrom(error_info(turn.error_reason))
    if turn.end_time is not None:
        result.end_time.CopyFrom(timestamp(turn.end_time))
    return result


def event_to_proto(event: SessionEvent) -> chat_pb2.ChatResponse:
    """A stored session event as its ``ChatResponse`` (sequence from the event).

    Raises ``ValueError`` when an event lacks the message or data its kind needs.
    """
    response = chat_pb2.ChatResponse(
        session_id=event.session_id, turn_id=event.turn_id, sequence=event.sequence
    )
    kind, data, message = event.kind, event.data, event.message
    if kind is EventKind.MESSAGE_ACCEPTED:
        response.message_accepted.message.CopyFrom(message_to_proto(_need(message, event)))
    elif kind is EventKind.MESSAGE_QUEUED:
        queued = _data(data, MessageQueuedData, event)
        response.message_queued.text = queued.text
        response.message_queued.behind_turn_id = queued.behind_turn_id
        response.message_queued.on_busy = ON_BUSY_TO_PROTO[queued.on_busy]
        response.message_queued.human_id = queued.human_id
    elif kind is EventKind.TURN_STARTED:
        started = _data(data, TurnStartedData, event)
        response.turn_started.model = started.model
        response.turn_started.max_rounds = started.max_rounds
    elif kind is EventKind.ASSISTANT_MESSAGE:
        response.assistant_message.message.CopyFrom(message_to_proto(_need(message, event)))
    elif kind is EventKind.TOOL_CALL_STARTED:
        response.tool_call_started.message.CopyFrom(message_to_proto(_need(message, event)))
    elif kind is EventKind.TOOL_CALL_FINISHED:
        response.tool_call_finished.message.CopyFrom(message_to_proto(_need(message, event)))
    elif kind is EventKind.CHANGESET_PROPOSED:
        proposed = _data(data, ChangesetProposedData, event)
        response.changeset_proposed.changeset_id = proposed.changeset_id
        response.changeset_proposed.tool_call_id = proposed.tool_call_id
    elif kind is EventKind.KNOWLEDGE_WRITTEN:
        written = _data(data, KnowledgeWrittenData, event)
        response.knowledge_written.entry_id = written.entry_id
        response.knowledge_written.version = written.version
        response.knowledge_written.tool_call_id = written.tool_call_id
    elif kind is EventKind.COMPACTED:
        marker = _need(message, event)
        compacted = data if isinstance(data, CompactedData) else None
        response.compacted.up_to = compacted.up_to if compacted else marker.up_to
        response.compacted.estimated_tokens = (
            compacted.estimated_tokens if compacted else marker.estimated_tokens
        )
        response.compacted.message.CopyFrom(message_to_proto(marker))
    elif kind is EventKind.TURN_ENDED:
        ended = _data(data, TurnEndedData, event)
        response.turn_ended.reason = END_REASONS[ended.reason]
        response.turn_ended.usage.CopyFrom(usage_to_proto(ended.usage))
        response.turn_ended.compaction_usage.CopyFrom(usage_to_proto(ended.compaction_usage))
        response.turn_ended.rounds = ended.rounds
        if ended.error_reason:
            response.turn_ended.error_info.CopyFrom(error_info(ended.error_reason))
        response.turn_ended.error_message = ended.error_message
    else:
        assert_never(kind)
    return response


def tool_call_progress_to_proto(progress: ToolCallProgress) -> chat_pb2.ChatResponse:
    """A ``tool_call_progress`` event: not stored, sequence 0 (docs/spec/api-and-streams.md, like
    text deltas)."""
    response = chat_pb2.ChatResponse(session_id=progress.session_id, turn_id=progress.turn_id)
    response.tool_call_progress.tool_call_id = progress.tool_call_id
    response.tool_call_progress.tool_name = progress.tool_name
    response.tool_call_progress.index = progress.index
    return response


def text_delta_to_proto(delta: TextDelta) -> chat_pb2.ChatResponse:
    """A text delta: not stored, ``sequence`` 0, with its message id and offset."""
    response = chat_pb2.ChatResponse(session_id=delta.session_id, turn_id=delta.turn_id)
    response.text_delta.message_id = delta.message_id
    response.text_delta.offset = delta.offset
    response.text_delta.text = delta.text
    return response


def session_opened(session: Session, request_id: str) -> chat_pb2.ChatResponse:
    """The reply to ``open``: ``sequence`` 0, echoing ``request_id``."""
    response = chat_pb2.ChatResponse(session_id=session.session_id, request_id=request_id)
    response.session_opened.session.CopyFrom(session_to_proto(session))
    return response


def error_response(
    status: status_pb2.Status, *, request_id: str = "", session_id: str = ""
) -> chat_pb2.ChatResponse:
    """The ``error`` reply (a ``google.rpc.Status`` from
    ``service.transport.errors.status_of``): ``sequence`` 0, echoing ``request_id``."""
    response = chat_pb2.ChatResponse(session_id=session_id, request_id=request_id)
    response.error.CopyFrom(status)
    return response


def _need(message: Message | None, event: SessionEvent) -> Message:
    if message is None:
        raise ValueError(f"{event.kind} event {event.sequence} has no message")
    return message


def _data(data: object, cls: type[_T], event: SessionEvent) -> _T:
    if not isinstance(data, cls):
        raise ValueError(f"{event.kind} event {event.sequence} has no {cls.__name__}")
    return data


def encoded_message_bytes(message: Message) -> int:
    """The bytes ``message`` adds to a ``ListMessagesResponse``: its encoding plus the
    repeated field's tag and length (at most 5 bytes), for the page byte cap
    (docs/spec/api-and-streams.md)."""
    return message_to_proto(message).ByteSize() + 5
