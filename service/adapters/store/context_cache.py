"""What the model sees of each session, kept in memory between turns (decision
0113).

A turn starts by loading its session's context (the session and the messages after the
summary, docs/spec/compaction.md). The replica that ran the session's last turn already holds it:
this cache keeps each session's snapshot as this process's store wrote it, and every unit of
work of the store moves it forward. An entry is trusted only while it is provably
current: a unit of work that numbers events from sequence ``n + 1`` applies to an entry
whose last sequence is ``n``, and drops any other entry of that session. So another
replica's writes (its turns, its compactions) are never missed: the next unit of work
here finds a gap and the next load reads the database.

The cache is bounded in bytes (least recently used sessions go first); it holds no
connection, task or timer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from service.core.estimate import messages_tokens
from service.core.model import (
    ContextEstimate,
    EventKind,
    Message,
    Session,
    SessionEvent,
    copied,
)
from service.core.ports import ContextSnapshot, SummaryUpdate

#: Bytes counted per message besides its text (the object and its fields).
_MESSAGE_OVERHEAD = 400


@dataclass
class _Entry:
    session: Session
    messages: list[Message]
    size: int


def _size(messages: Sequence[Message]) -> int:
    return sum(message.size_bytes() + _MESSAGE_OVERHEAD for message in messages)


class ContextCache:
    """Per-session context snapshots, at most ``max_bytes`` in all (0: off)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    def get(self, session_id: str) -> ContextSnapshot | None:
        """The session's snapshot (its own message list), or None when not kept."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        self._entries.move_to_end(session_id)
        return ContextSnapshot(entry.session, list(entry.messages))

    def put(self, snapshot: ContextSnapshot) -> None:
        """Keep a snapshot just read from the database."""
        self.drop(snapshot.session.session_id)
        if self._max_bytes <= 0:
            return
        messages = list(snapshot.messages)
        self._add(snapshot.session.session_id, _Entry(snapshot.session, messages, _size(messages)))

    def drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def advance(
        self,
        events: Sequence[SessionEvent],
        *,
        session_id: str,
        last_sequence: int,
        turn_ended: bool = False,
        running_turn_id: str | None = None,
        summary: SummaryUpdate | None = None,
        context: ContextEstimate | None = None,
    ) -> None:
        """Apply a unit of work that stored ``events`` (numbered up to
        ``last_sequence``) in ``session_id``, if the entry is exactly the state before
        it; otherwise forget the entry. ``running_turn_id`` is a turn just started,
        ``turn_ended`` the end of the running one; ``summary`` and ``context`` as in
        ``TurnCommit``."""
        entry = self._entries.get(session_id)
        if entry is None:
            return
        if entry.session.last_sequence != last_sequence - len(events):
            self.drop(session_id)
            return
        stored = [
            event.message
            for event in events
            if event.message is not None and event.kind is not EventKind.COMPACTED
        ]
        session = entry.session
        messages = entry.messages
        if summary is not None:
            kept = [m for m in messages if m.sequence > summary.up_to]
            self._bytes -= _size(messages) - _size(kept)
            entry.size -= _size(messages) - _size(kept)
            messages = kept
        messages.extend(stored)
        grown = _size(stored)
        if context is None:
            added = messages_tokens(e.message for e in events if e.message is not None)
            context = ContextEstimate(
                session.context.base_tokens, session.context.pending_tokens + added
            )
        running = session.running_turn_id
        if running_turn_id is not None:
            running = running_turn_id
        elif turn_ended:
            running = ""
        entry.session = copied(
            session,
            last_sequence=last_sequence,
            context=context,
            running_turn_id=running,
            summary=session.summary if summary is None else summary.summary,
            summary_up_to=session.summary_up_to if summary is None else summary.up_to,
        )
        entry.messages = messages
        entry.size += grown
        self._bytes += grown
        self._entries.move_to_end(session_id)
        self._evict()

    def _add(self, session_id: str, entry: _Entry) -> None:
        self._entries[session_id] = entry
        self._bytes += entry.size
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self._max_bytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.size
