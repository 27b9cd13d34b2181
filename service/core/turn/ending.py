"""The one ending of a turn (docs/spec/turn-loop.md: the end of a turn, cancel and interruption,
ownership and recovery; decision 0070).

However a turn ends (the loop's own end, a cancel, a timeout, the loss of the database, a
replica that died, start-up, shutdown), the ending is the same commit: every tool call of
the turn without a stored result gets a synthetic error result, so the next model request
pairs every call with a result, then ``turn_ended`` with the turn's totals; the turn row
ends in the same transaction. Calls and results are paired by the planner's own call id,
never by a provider's id (providers reuse theirs).

The loop ends its turn from what it holds in memory (``closing_commit``); a turn no run of
this process holds is closed from what is stored (``close_stored_turn``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from service.core.errors import StoreConflict
from service.core.fanout import Hub
from service.core.model import (
    ContextEstimate,
    Message,
    MessageKind,
    Session,
    SessionEvent,
    Turn,
    copied,
)
from service.core.model import TurnEndReason as Reason
from service.core.ports import Clock, Promoted, Promotion, SessionStore, TurnCommit, TurnPatch
from service.core.tools import WRITE_TOOLS, ToolOutcome, error_result
from service.core.turn.events import EventBuilder, Totals
from service.core.turn.settings import TurnDependencies, TurnObserver
from service.core.turn.telling import StoreThenTell

#: Told of a queued turn an ending started (decision 0300), with the session when the
#: ending knew it: the turn service launches it on this replica.
OnPromoted = Callable[[Promoted, Session | None], None]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ending:
    """How a turn ends: ``reason``, and for FAILED an ErrorInfo ``error_reason``
    (``MODEL_UNAVAILABLE``, ``TURN_TIMEOUT``, ...) and a message for humans."""

    reason: Reason
    error_reason: str = ""
    message: str = ""


COMPLETED = Ending(Reason.COMPLETED)
MAX_ROUNDS = Ending(Reason.MAX_ROUNDS)
CANCELLED = Ending(Reason.CANCELLED)
#: A message sent with ``on_busy`` INTERRUPT stopped the turn (decision 0301).
INTERRUPTED_BY_MESSAGE = Ending(Reason.INTERRUPTED_BY_MESSAGE)
#: A replica stopped (crash, shutdown past its grace): what start-up recovery finds of
#: its own turns.
INTERRUPTED = Ending(Reason.INTERRUPTED, "INTERRUPTED", "the replica running the turn stopped")
#: A turn whose lease expired, closed by another run (the sweeper, a send, a cancel): its
#: replica stopped or could not reach the database; which one, nobody here knows
#: (decision 0311).
LEASE_EXPIRED = Ending(
    Reason.INTERRUPTED,
    "INTERRUPTED",
    "the turn's lease expired: the replica running it stopped or lost the database",
)
#: The lease renewal found the turn closed or taken over by another replica.
TAKEN_OVER = Ending(
    Reason.INTERRUPTED, "INTERRUPTED", "another replica closed the turn while it ran here"
)
SHUTTING_DOWN = Ending(Reason.INTERRUPTED, "INTERRUPTED", "the planner is shutting down")
TURN_TIMEOUT = Ending(Reason.FAILED, "TURN_TIMEOUT", "the turn ran out of time")
CREDENTIAL_EXPIRED = Ending(Reason.FAILED, "CREDENTIAL_EXPIRED", "the human's token expired")
DATABASE_UNAVAILABLE = Ending(
    Reason.FAILED,
    "DATABASE_UNAVAILABLE",
    "the database became unavailable during the turn",
)


def cancel_ending(cancel_reason: str) -> Ending:
    """The ending of a turn whose cancel was requested with ``Turn.cancel_reason``."""
    if cancel_reason == Reason.INTERRUPTED_BY_MESSAGE.value:
        return INTERRUPTED_BY_MESSAGE
    return CANCELLED


def promotion(deps: TurnDependencies) -> Promotion:
    """How an ending on this replica starts the session's next queued turn: owned here,
    under a fresh lease (decision 0300; TEAM decision 2: it runs where the turn before it
    ended)."""
    settings = deps.settings
    return Promotion(
        owner=deps.replica_id,
        lease_expires_at=deps.clock.now() + timedelta(seconds=settings.lease_s),
        model=settings.model,
        max_rounds=settings.max_rounds,
    )


#: An answer stopped at its output cap: a text answer cut there (decision 0291).
OUTPUT_LIMIT = Ending(Reason.OUTPUT_LIMIT, "OUTPUT_LIMIT", "the answer stopped at its output limit")
#: A second answer of the turn cut at its output limit inside a tool call (decision 0292).
CUT_TWICE = Ending(
    Reason.OUTPUT_LIMIT,
    "OUTPUT_LIMIT_CUT_CALLS",
    "two answers of the turn were cut at the output limit inside a tool call",
)


def budget_exhausted(budget: str, message: str) -> Ending:
    """The turn ends before a call that would not fit its ``budget`` (``model_requests``,
    ``tool_calls`` or ``tokens``; decision 0291); the ErrorInfo-style reason names it."""
    return Ending(Reason.BUDGET_EXHAUSTED, f"TURN_BUDGET_{budget.upper()}", message)


def failed(error_reason: str, message: str) -> Ending:
    """A FAILED ending with an ErrorInfo reason."""
    return Ending(Reason.FAILED, error_reason, message)


def synthetic_outcome(reason: Reason, tool_name: str) -> ToolOutcome:
    """The result of a call a stopped turn could not finish (docs/spec/turn-loop.md: "cancelled;
    the outcome is unknown" for a write, since it may have happened)."""
    is_write = tool_name in WRITE_TOOLS
    if reason is Reason.INTERRUPTED:
        return error_result("INTERRUPTED", "interrupted; the outcome is unknown")
    if reason in (Reason.CANCELLED, Reason.INTERRUPTED_BY_MESSAGE):
        text = "cancelled; the outcome is unknown" if is_write else "cancelled"
        return error_result("CANCELLED", text)
    # FAILED (turn timeout, lost database, ...): the call may or may not have run.
    text = "the turn ended; the outcome is unknown" if is_write else "the turn ended; no result"
    return error_result("TURN_ENDED", text)


def unanswered_calls(messages: Iterable[Message], turn_id: str) -> list[Message]:
    """The tool calls of turn ``turn_id`` among ``messages`` that have no result, in
    order, paired by the planner's call id."""
    calls: dict[str, Message] = {}
    for message in messages:
        if message.turn_id != turn_id:
            continue
        if message.kind is MessageKind.TOOL_CALL:
            calls[message.tool_call_id] = message
        elif message.kind is MessageKind.TOOL_RESULT:
            calls.pop(message.tool_call_id, None)
    return list(calls.values())


def closing_commit(
    events: EventBuilder,
    ending: Ending,
    totals: Totals,
    messages: Iterable[Message],
    *,
    pending: Sequence[SessionEvent] = (),
    patch: TurnPatch | None = None,
    context: ContextEstimate | None = None,
    owner: str | None = None,
    lease_expired_before: datetime | None = None,
) -> TurnCommit:
    """The commit that ends a turn: ``pending`` (e.g. the final or cut answer), a
    synthetic result for every call of the turn in ``messages`` (and in ``pending``)
    without one, then ``turn_ended``; the turn row gets ``patch`` (versions) with the
    totals and the end. ``owner`` and ``lease_expired_before`` are the commit's
    conditions (``TurnCommit``)."""
    stored = [*messages, *(e.message for e in pending if e.message is not None)]
    closing = list(pending)
    for call in unanswered_calls(stored, events.turn_id):
        outcome = synthetic_outcome(ending.reason, call.tool_name)
        closing.extend(events.tool_result(call.tool_call_id, call.tool_name, outcome))
    closing.append(
        events.turn_ended(
            ending.reason, totals, error_reason=ending.error_reason, error_message=ending.message
        )
    )
    return TurnCommit(
        session_id=events.session_id,
        turn_id=events.turn_id,
        now=events.clock.now(),
        events=closing,
        turn_patch=copied(
            patch or TurnPatch(),
            rounds=totals.rounds,
            usage=totals.usage,
            compaction_usage=totals.compaction_usage,
            writes=totals.writes,
            end_reason=ending.reason,
            error_reason=ending.error_reason,
            error_message=ending.message,
        ),
        context=context,
        owner=owner,
        lease_expired_before=lease_expired_before,
    )


async def close_stored_turn(
    store: SessionStore,
    hub: Hub,
    clock: Clock,
    observer: TurnObserver,
    turn: Turn,
    ending: Ending = INTERRUPTED,
    *,
    owner: str | None = None,
    lease_expired_before: datetime | None = None,
    pending: Sequence[SessionEvent] = (),
    promote: Promotion | None = None,
    on_promoted: OnPromoted | None = None,
) -> bool:
    """Close a turn no run of this process holds, from its stored messages (a dead
    replica's, this replica's own after a restart or a lost database, or a shutdown's
    leftovers); ``turn``'s rounds and usage are stored with the end. ``pending`` are
    events its run held and had not stored (a round of reads, decision 0114): they are
    stored with the end unless they turn out to be stored already (a commit that landed
    before its connection broke).

    With ``promote``, the same transaction starts the session's next queued turn, which
    is published after the ending and handed to ``on_promoted`` (decision 0300).

    Returns False when the turn ended meanwhile or a condition failed (another replica
    won the race); raises ``StoreUnavailable``.
    """
    messages = await store.turn_messages(turn.turn_id)
    stored_ids = {m.message_id for m in messages}
    if any(e.message is not None and e.message.message_id in stored_ids for e in pending):
        pending = ()
    events = EventBuilder(turn.session_id, turn.turn_id, turn.human_id, clock)
    totals = Totals(turn.rounds, turn.usage, turn.compaction_usage, turn.writes)
    commit = closing_commit(
        events,
        ending,
        totals,
        messages,
        pending=pending,
        owner=owner,
        lease_expired_before=lease_expired_before,
    )
    promoted: Promoted | None = None
    telling = StoreThenTell(store, hub, observer)
    try:
        if promote is None:
            await telling.commit(commit, turn)
        else:
            promoted = (await telling.end(commit, turn, promote)).promoted
    except StoreConflict:
        return False
    log.info(
        "closed turn %s",
        ending.reason.value,
        extra={"session": turn.session_id, "turn": turn.turn_id},
    )
    if promoted is not None and on_promoted is not None:
        on_promoted(promoted, None)
    return True
