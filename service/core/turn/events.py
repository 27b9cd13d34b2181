"""Typed builders of the session events a turn stores (docs/spec/api-and-streams.md, "Two kinds of
server event").

Every session event the planner makes is built here, by an ``EventBuilder`` bound to one
turn: the turn service (``message_accepted``, ``turn_started``), the loop (answers, tool
calls and results, compactions, the end) and the ending of a turn no run holds
(recovery, start-up, shutdown). A message event carries its ``Message``; the store
numbers both with one sequence when it commits them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.core.ids import new_message_id
from service.core.model import (
    ChangesetProposedData,
    CompactedData,
    EventData,
    EventKind,
    KnowledgeWrittenData,
    Message,
    MessageKind,
    MessageQueuedData,
    OnBusy,
    SessionEvent,
    TurnEndedData,
    TurnEndReason,
    TurnStartedData,
    Usage,
    copied,
)
from service.core.ports.clock import Clock
from service.core.tools import ToolOutcome


@dataclass(frozen=True)
class Totals:
    """What a turn used and did, as stored with its end: model calls' usage (answers and
    compactions apart; docs/spec/compaction.md), rounds, write calls."""

    rounds: int = 0
    usage: Usage = field(default_factory=Usage)
    compaction_usage: Usage = field(default_factory=Usage)
    writes: int = 0


@dataclass(frozen=True)
class EventBuilder:
    """Builds the events of turn ``turn_id`` of session ``session_id``, whose messages
    came from or acted for ``human_id``; times come from ``clock``."""

    session_id: str
    turn_id: str
    human_id: str
    clock: Clock

    def message_accepted(self, text: str, request_id: str = "") -> SessionEvent:
        """``message_accepted`` storing the human message that starts the turn; live, it
        carries the sender's ``request_id`` (``SessionEvent.request_id``, not stored)."""
        event = self._stored(EventKind.MESSAGE_ACCEPTED, MessageKind.HUMAN, text=text)
        return copied(event, request_id=request_id) if request_id else event

    def message_queued(self, text: str, on_busy: OnBusy, request_id: str = "") -> SessionEvent:
        """``message_queued``: the human message waits as this (queued) turn; the store
        fills in the turn it waits behind (decision 0300). Live, it carries the sender's
        ``request_id``, as ``message_accepted`` does."""
        data = MessageQueuedData(text, "", on_busy, self.human_id)
        event = self._event(EventKind.MESSAGE_QUEUED, data=data)
        return copied(event, request_id=request_id) if request_id else event

    def turn_started(self, model: str, max_rounds: int) -> SessionEvent:
        """``turn_started`` with the model and the round budget."""
        return self._event(EventKind.TURN_STARTED, data=TurnStartedData(model, max_rounds))

    def assistant_message(
        self,
        message_id: str,
        text: str,
        *,
        usage: Usage | None,
        cut: bool = False,
        finish_reason: str = "",
        served_model: str = "",
    ) -> SessionEvent:
        """``assistant_message`` storing an answer's text under ``message_id`` (the id
        its text deltas carried). ``cut`` marks a partial answer; ``finish_reason`` is
        the provider's reason when it is not a normal end (``length``,
        ``content_filter``, ``refusal``), or ``truncated`` for a stream that ended
        without one; empty otherwise (a cut answer with none was stopped or failed)."""
        return self._stored(
            EventKind.ASSISTANT_MESSAGE,
            MessageKind.ASSISTANT,
            message_id=message_id,
            text=text,
            usage=usage,
            cut=cut,
            finish_reason=finish_reason,
            served_model=served_model,
        )

    def tool_call(
        self,
        call_id: str,
        name: str,
        arguments: str,
        *,
        provider_call_id: str = "",
        cut: bool = False,
    ) -> SessionEvent:
        """``tool_call_started`` storing a call under the planner's id ``call_id`` (unique
        in the session); ``provider_call_id`` is the id the provider gave it; ``cut``
        marks arguments stored cut, over the bound a call may have (decision 0221)."""
        return self._stored(
            EventKind.TOOL_CALL_STARTED,
            MessageKind.TOOL_CALL,
            tool_call_id=call_id,
            provider_call_id=provider_call_id,
            tool_name=name,
            tool_arguments=arguments,
            cut=cut,
        )

    def tool_result(self, call_id: str, name: str, outcome: ToolOutcome) -> list[SessionEvent]:
        """``tool_call_finished`` storing the result of call ``call_id``, followed by
        ``changeset_proposed`` or ``knowledge_written`` when the call wrote one
        (docs/spec/authority.md, Containment)."""
        events = [
            self._stored(
                EventKind.TOOL_CALL_FINISHED,
                MessageKind.TOOL_RESULT,
                tool_call_id=call_id,
                tool_name=name,
                tool_result=outcome.content,
                tool_error=outcome.is_error,
            )
        ]
        if outcome.changeset_id:
            data: EventData = ChangesetProposedData(outcome.changeset_id, call_id)
            events.append(self._event(EventKind.CHANGESET_PROPOSED, data=data))
        if outcome.knowledge_entry_id:
            data = KnowledgeWrittenData(
                outcome.knowledge_entry_id, outcome.knowledge_version, call_id
            )
            events.append(self._event(EventKind.KNOWLEDGE_WRITTEN, data=data))
        return events

    def compacted(
        self, up_to: int, estimated_tokens: int, prompt_version: str = ""
    ) -> SessionEvent:
        """``compacted`` (the ``planner.compacted`` event) storing the compaction marker,
        with the version of the summary instructions that wrote the summary."""
        return self._stored(
            EventKind.COMPACTED,
            MessageKind.COMPACTION,
            data=CompactedData(up_to, estimated_tokens),
            up_to=up_to,
            estimated_tokens=estimated_tokens,
            prompt_version=prompt_version,
        )

    def turn_ended(
        self,
        reason: TurnEndReason,
        totals: Totals,
        *,
        error_reason: str = "",
        error_message: str = "",
    ) -> SessionEvent:
        """``turn_ended`` with the reason, usage and rounds (``error_reason`` for FAILED)."""
        data = TurnEndedData(
            reason=reason,
            usage=totals.usage,
            compaction_usage=totals.compaction_usage,
            rounds=totals.rounds,
            error_reason=error_reason,
            error_message=error_message,
        )
        return self._event(EventKind.TURN_ENDED, data=data)

    def _event(
        self, kind: EventKind, *, message: Message | None = None, data: EventData | None = None
    ) -> SessionEvent:
        return SessionEvent(
            self.session_id, self.turn_id, kind, self.clock.now(), message=message, data=data
        )

    def _stored(
        self,
        kind: EventKind,
        message_kind: MessageKind,
        *,
        data: EventData | None = None,
        message_id: str = "",
        **fields: Any,
    ) -> SessionEvent:
        now = self.clock.now()
        message = Message(
            session_id=self.session_id,
            turn_id=self.turn_id,
            message_id=message_id or new_message_id(),
            kind=message_kind,
            create_time=now,
            human_id=self.human_id,
            **fields,
        )
        return SessionEvent(self.session_id, self.turn_id, kind, now, message=message, data=data)
