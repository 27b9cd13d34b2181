"""Closing a turn from what is stored: interruption and failure (SPEC section 5,
Ownership and recovery; decision 0070).

A turn that no run of this process holds (its replica died, or its run lost the
database) is closed from its stored messages: every tool call without a stored result
gets a synthetic error result, so the next model request pairs every call with a result.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Protocol

from service.core.errors import StoreConflict
from service.core.fanout import Hub
from service.core.ids import new_id
from service.core.model import (
    EventKind,
    Message,
    MessageKind,
    SessionEvent,
    Turn,
    TurnEndedData,
    TurnEndReason,
)
from service.core.ports import Clock, SessionStore, TurnCommit, TurnPatch
from service.core.tools import TOOLS_BY_NAME, ToolOutcome, error_result

log = logging.getLogger(__name__)


class TurnObserverLike(Protocol):
    """The part of ``TurnObserver`` closing a turn reports to."""

    def turn_ended(
        self,
        reason: TurnEndReason,
        error_reason: str,
        rounds: int = 0,
        seconds: float | None = None,
    ) -> None: ...


async def close_turn(
    store: SessionStore,
    hub: Hub,
    clock: Clock,
    observer: TurnObserverLike,
    turn: Turn,
    *,
    owner: str | None = None,
    lease_expired_before: datetime | None = None,
    reason: TurnEndReason = TurnEndReason.INTERRUPTED,
    error_reason: str = "INTERRUPTED",
    error_message: str = "the replica running the turn stopped",
) -> None:
    """Close a turn no run of this process holds ``INTERRUPTED``, like a cancel, from
    its stored messages: every call without a stored result gets a synthetic one.

    ``reason``, ``error_reason`` and ``error_message`` override the ending (a run
    that lost its database closes its own turn ``FAILED``). ``turn``'s rounds and
    usage are stored with the ending. A turn that ended meanwhile, or whose commit
    conditions fail, is left alone; raises ``StoreUnavailable``.
    """
    messages = await store.turn_messages(turn.turn_id)
    answered = {m.tool_call_id for m in messages if m.kind is MessageKind.TOOL_RESULT}
    now = clock.now()
    events: list[SessionEvent] = []
    for message in messages:
        if message.kind is MessageKind.TOOL_CALL and message.tool_call_id not in answered:
            outcome = synthetic_outcome(reason, is_write_tool(message.tool_name))
            events.append(
                SessionEvent(
                    turn.session_id,
                    turn.turn_id,
                    EventKind.TOOL_CALL_FINISHED,
                    now,
                    message=Message(
                        session_id=turn.session_id,
                        turn_id=turn.turn_id,
                        message_id=new_id("msg"),
                        kind=MessageKind.TOOL_RESULT,
                        create_time=now,
                        tool_call_id=message.tool_call_id,
                        tool_name=message.tool_name,
                        tool_result=outcome.content,
                        tool_error=True,
                        human_id=turn.human_id,
                    ),
                )
            )
    events.append(
        SessionEvent(
            turn.session_id,
            turn.turn_id,
            EventKind.TURN_ENDED,
            now,
            data=TurnEndedData(
                reason=reason,
                usage=turn.usage,
                compaction_usage=turn.compaction_usage,
                rounds=turn.rounds,
                error_reason=error_reason,
                error_message=error_message,
            ),
        )
    )
    try:
        stored = await store.commit(
            TurnCommit(
                session_id=turn.session_id,
                turn_id=turn.turn_id,
                now=now,
                events=events,
                turn_patch=TurnPatch(
                    rounds=turn.rounds,
                    usage=turn.usage,
                    compaction_usage=turn.compaction_usage,
                    end_reason=reason,
                    error_reason=error_reason,
                    error_message=error_message,
                ),
                owner=owner,
                lease_expired_before=lease_expired_before,
            )
        )
    except StoreConflict:
        return
    observer.turn_ended(reason, error_reason)
    log.info(
        "closed turn %s",
        reason.value,
        extra={"session": turn.session_id, "turn": turn.turn_id},
    )
    hub.publish(stored)


def synthetic_outcome(reason: TurnEndReason, is_write: bool) -> ToolOutcome:
    """The result of a call a stopped turn could not finish (SPEC section 5)."""
    if reason is TurnEndReason.INTERRUPTED:
        return error_result("INTERRUPTED", "interrupted; the outcome is unknown")
    if reason is TurnEndReason.CANCELLED:
        text = "cancelled; the outcome is unknown" if is_write else "cancelled"
        return error_result("CANCELLED", text)
    # FAILED (turn timeout, lost database): the call may or may not have run.
    text = "the turn ended; the outcome is unknown" if is_write else "the turn ended; no result"
    return error_result("TURN_ENDED", text)


def is_write_tool(name: str) -> bool:
    spec = TOOLS_BY_NAME.get(name)
    return spec is not None and spec.is_write
