"""Rows <-> domain values for the SQL store (``service.core.model``).

Every function here is pure: it maps one row (a ``RowMapping``) to one frozen domain
value, or one domain value to the column values of one row. Event payloads
(``EventData``) are stored as compact JSON whose shape is one object per payload type,
chosen by the event's kind (``DATA_TYPES``); a payload of another type than its kind's is
refused when stored (``ValueError``), so reading it back can never guess.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol

from service.core.model import (
    ChangesetProposedData,
    CompactedData,
    ContextEstimate,
    EventData,
    EventKind,
    KnowledgeWrittenData,
    Message,
    MessageKind,
    MessageQueuedData,
    OnBusy,
    Session,
    SessionEvent,
    Turn,
    TurnEndedData,
    TurnEndReason,
    TurnStartedData,
    TurnState,
    Usage,
)

#: The payload type of each event kind that carries one.
DATA_TYPES: dict[EventKind, type[EventData]] = {
    EventKind.TURN_STARTED: TurnStartedData,
    EventKind.TURN_ENDED: TurnEndedData,
    EventKind.CHANGESET_PROPOSED: ChangesetProposedData,
    EventKind.KNOWLEDGE_WRITTEN: KnowledgeWrittenData,
    EventKind.COMPACTED: CompactedData,
    EventKind.MESSAGE_QUEUED: MessageQueuedData,
}


class Row(Protocol):
    """A row of the store by column name: SQLAlchemy's ``RowMapping`` or psycopg's
    ``dict_row``."""

    def __getitem__(self, key: str, /) -> Any: ...


# ------------------------------------------------------------------ event payloads


def encode_data(kind: EventKind, data: EventData | None) -> str | None:
    """The JSON text stored in ``session_events.data``; None for no payload.

    Raises ``ValueError`` when ``data`` is not the payload type of ``kind``.
    """
    if data is None:
        return None
    expected = DATA_TYPES.get(kind)
    if expected is None or not isinstance(data, expected):
        raise ValueError(f"a {kind.value} event cannot carry {type(data).__name__}")
    fields: dict[str, Any]
    match data:
        case TurnEndedData():
            fields = {
                "reason": data.reason.value,
                "usage": _usage_json(data.usage),
                "compaction_usage": _usage_json(data.compaction_usage),
                "rounds": data.rounds,
                "error_reason": data.error_reason,
                "error_message": data.error_message,
            }
        case TurnStartedData():
            fields = {"model": data.model, "max_rounds": data.max_rounds}
        case ChangesetProposedData():
            fields = {"changeset_id": data.changeset_id, "tool_call_id": data.tool_call_id}
        case KnowledgeWrittenData():
            fields = {
                "entry_id": data.entry_id,
                "version": data.version,
                "tool_call_id": data.tool_call_id,
            }
        case CompactedData():
            fields = {"up_to": data.up_to, "estimated_tokens": data.estimated_tokens}
        case MessageQueuedData():
            fields = {
                "text": data.text,
                "behind_turn_id": data.behind_turn_id,
                "on_busy": data.on_busy.value,
                "human_id": data.human_id,
            }
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False)


def decode_data(kind: EventKind, raw: str | None) -> EventData | None:
    """The payload stored by ``encode_data`` for an event of ``kind``."""
    if raw is None:
        return None
    fields = json.loads(raw)
    expected = DATA_TYPES.get(kind)
    if expected is TurnEndedData:
        return TurnEndedData(
            reason=TurnEndReason(fields["reason"]),
            usage=_usage_from_json(fields["usage"]),
            compaction_usage=_usage_from_json(fields["compaction_usage"]),
            rounds=fields["rounds"],
            error_reason=fields["error_reason"],
            error_message=fields["error_message"],
        )
    if expected is TurnStartedData:
        return TurnStartedData(model=fields["model"], max_rounds=fields["max_rounds"])
    if expected is ChangesetProposedData:
        return ChangesetProposedData(
            changeset_id=fields["changeset_id"], tool_call_id=fields["tool_call_id"]
        )
    if expected is KnowledgeWrittenData:
        return KnowledgeWrittenData(
            entry_id=fields["entry_id"],
            version=fields["version"],
            tool_call_id=fields["tool_call_id"],
        )
    if expected is CompactedData:
        return CompactedData(up_to=fields["up_to"], estimated_tokens=fields["estimated_tokens"])
    if expected is MessageQueuedData:
        return MessageQueuedData(
            text=fields["text"],
            behind_turn_id=fields["behind_turn_id"],
            on_busy=OnBusy(fields["on_busy"]),
            human_id=fields["human_id"],
        )
    raise ValueError(f"a stored {kind.value} event has a payload: {raw!r}")


def _usage_json(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}


def _usage_from_json(fields: Mapping[str, int]) -> Usage:
    return Usage(input_tokens=fields["input_tokens"], output_tokens=fields["output_tokens"])


# ------------------------------------------------------------------ messages


def message_row(message: Message) -> dict[str, Any]:
    """The ``messages`` columns of a numbered message."""
    return {
        "session_id": message.session_id,
        "sequence": message.sequence,
        "message_id": message.message_id,
        "turn_id": message.turn_id,
        "kind": message.kind.value,
        "create_time": message.create_time,
        "text": message.text,
        "cut": message.cut,
        "finish_reason": message.finish_reason,
        "tool_call_id": message.tool_call_id,
        "provider_call_id": message.provider_call_id,
        "tool_name": message.tool_name,
        "tool_arguments": message.tool_arguments,
        "tool_result": message.tool_result,
        "tool_error": message.tool_error,
        "human_id": message.human_id,
        "usage_input_tokens": None if message.usage is None else message.usage.input_tokens,
        "usage_output_tokens": None if message.usage is None else message.usage.output_tokens,
        "up_to": message.up_to,
        "estimated_tokens": message.estimated_tokens,
        "size_bytes": message.size_bytes(),
        "served_model": message.served_model,
        "prompt_version": message.prompt_version,
    }


def message_from_row(row: Row, prefix: str = "") -> Message:
    """A ``Message`` from a ``messages`` row whose column names carry ``prefix``."""
    usage_in = row[prefix + "usage_input_tokens"]
    usage = (
        None
        if usage_in is None
        else Usage(input_tokens=usage_in, output_tokens=row[prefix + "usage_output_tokens"] or 0)
    )
    return Message(
        session_id=row[prefix + "session_id"],
        turn_id=row[prefix + "turn_id"],
        message_id=row[prefix + "message_id"],
        kind=MessageKind(row[prefix + "kind"]),
        create_time=row[prefix + "create_time"],
        sequence=row[prefix + "sequence"],
        text=row[prefix + "text"],
        cut=bool(row[prefix + "cut"]),
        finish_reason=row[prefix + "finish_reason"],
        tool_call_id=row[prefix + "tool_call_id"],
        provider_call_id=row[prefix + "provider_call_id"],
        tool_name=row[prefix + "tool_name"],
        tool_arguments=row[prefix + "tool_arguments"],
        tool_result=row[prefix + "tool_result"],
        tool_error=bool(row[prefix + "tool_error"]),
        human_id=row[prefix + "human_id"],
        usage=usage,
        up_to=row[prefix + "up_to"],
        estimated_tokens=row[prefix + "estimated_tokens"],
        served_model=_optional_text(row, prefix + "served_model"),
        prompt_version=_optional_text(row, prefix + "prompt_version"),
    )


def _optional_text(row: Row, key: str) -> str:
    """A text column added by a later migration (0010): '' when NULL or not selected."""
    try:
        value = row[key]
    except (KeyError, IndexError):
        return ""
    return value or ""


# ------------------------------------------------------------------ events


def event_row(event: SessionEvent) -> dict[str, Any]:
    """The ``session_events`` columns of a numbered event (its message is stored apart)."""
    return {
        "session_id": event.session_id,
        "sequence": event.sequence,
        "turn_id": event.turn_id,
        "kind": event.kind.value,
        "create_time": event.create_time,
        "data": encode_data(event.kind, event.data),
    }


def event_from_row(row: Row, message_prefix: str) -> SessionEvent:
    """A ``SessionEvent`` from a ``session_events`` row joined (outer) with its message,
    whose columns carry ``message_prefix``."""
    kind = EventKind(row["kind"])
    has_message = row[message_prefix + "message_id"] is not None
    return SessionEvent(
        session_id=row["session_id"],
        turn_id=row["turn_id"],
        kind=kind,
        create_time=row["create_time"],
        sequence=row["sequence"],
        message=message_from_row(row, message_prefix) if has_message else None,
        data=decode_data(kind, row["data"]),
    )


# ------------------------------------------------------------------ turns


def turn_row(turn: Turn) -> dict[str, Any]:
    """The ``turns`` columns of a turn (``project_id`` is added by the caller)."""
    return {
        "turn_id": turn.turn_id,
        "session_id": turn.session_id,
        "human_id": turn.human_id,
        "state": turn.state.value,
        "start_time": turn.start_time,
        "end_time": turn.end_time,
        "human_sequence": turn.human_sequence,
        "request_id": turn.request_id,
        "request_hash": turn.request_hash,
        "end_reason": None if turn.end_reason is None else turn.end_reason.value,
        "error_reason": turn.error_reason,
        "error_message": turn.error_message,
        "rounds": turn.rounds,
        "usage_input_tokens": turn.usage.input_tokens,
        "usage_output_tokens": turn.usage.output_tokens,
        "compaction_input_tokens": turn.compaction_usage.input_tokens,
        "compaction_output_tokens": turn.compaction_usage.output_tokens,
        "writes": turn.writes,
        "instructions_version": turn.instructions_version,
        "tool_schema_version": turn.tool_schema_version,
        "skill_name": turn.skill_name,
        "skill_version": turn.skill_version,
        "model": turn.model,
        "owner": turn.owner,
        "lease_expires_at": turn.lease_expires_at,
        "cancel_requested": turn.cancel_requested,
        "behind_turn_id": turn.behind_turn_id,
        "cancel_reason": turn.cancel_reason,
        # A queued turn's message, token and place are the store's to set (decision
        # 0300); every row names every column (``planner_start_turn`` fills none in).
        "queued_message": None,
        "queued_token": None,
        "queued_tokens": 0,
        "queue_priority": 0,
        "on_busy": "",
        "join_pending": turn.join_pending,
    }


def turn_from_row(row: Row) -> Turn:
    """A ``Turn`` from a ``turns`` row."""
    end_reason = row["end_reason"]
    return Turn(
        turn_id=row["turn_id"],
        session_id=row["session_id"],
        human_id=row["human_id"],
        state=TurnState(row["state"]),
        start_time=row["start_time"],
        human_sequence=row["human_sequence"],
        request_id=row["request_id"],
        request_hash=row["request_hash"],
        end_reason=None if end_reason is None else TurnEndReason(end_reason),
        error_reason=row["error_reason"],
        error_message=row["error_message"],
        rounds=row["rounds"],
        usage=Usage(row["usage_input_tokens"], row["usage_output_tokens"]),
        compaction_usage=Usage(row["compaction_input_tokens"], row["compaction_output_tokens"]),
        writes=row["writes"],
        instructions_version=row["instructions_version"],
        tool_schema_version=row["tool_schema_version"],
        skill_name=row["skill_name"],
        skill_version=row["skill_version"],
        model=row["model"],
        owner=row["owner"],
        lease_expires_at=row["lease_expires_at"],
        cancel_requested=bool(row["cancel_requested"]),
        end_time=row["end_time"],
        behind_turn_id=row["behind_turn_id"],
        cancel_reason=row["cancel_reason"],
        join_pending=bool(row["join_pending"]),
        queued_text=queued_text(row["queued_message"]),
    )


def queued_message_json(message: Message) -> str:
    """A queued turn's human message as ``turns.queued_message`` keeps it: the
    ``messages`` row as JSON, without session and sequence (decision 0300)."""
    row = message_row(message)
    del row["session_id"], row["sequence"]
    row["create_time"] = message.create_time.isoformat()
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False)


def queued_message_from_json(raw: str, session_id: str, sequence: int) -> Message:
    """The message ``queued_message_json`` kept, numbered ``sequence``."""
    row = json.loads(raw)
    row["create_time"] = datetime.fromisoformat(row["create_time"])
    return message_from_row({**row, "session_id": session_id, "sequence": sequence})


def queued_text(raw: str | None) -> str:
    """The text of a queued turn's message; empty once the turn started."""
    return "" if raw is None else str(json.loads(raw)["text"])


# ------------------------------------------------------------------ sessions


def session_from_row(row: Row) -> Session:
    """A ``Session`` from a ``sessions`` row with a ``running_turn_id`` column (NULL when
    no turn runs)."""
    return Session(
        session_id=row["session_id"],
        project_id=row["project_id"],
        organization_id=row["organization_id"],
        owner_id=row["owner_id"],
        title=row["title"],
        create_time=row["create_time"],
        update_time=row["update_time"],
        summary=row["summary"],
        summary_up_to=row["summary_up_to"],
        last_sequence=row["last_sequence"],
        running_turn_id=row["running_turn_id"] or "",
        context=ContextEstimate(
            base_tokens=row["context_base_tokens"],
            pending_tokens=row["context_pending_tokens"],
        ),
        create_request_id=row["create_request_id"],
    )
