"""Bus port: cross-replica signals received by this replica and a stream's view of one
session's events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from service.core.model import SessionEvent


class Subscription(Protocol):
    """A stream's view of one session's events: session events and text deltas."""

    def __aiter__(self) -> AsyncIterator[SessionEvent | object]: ...

    def close(self) -> None: ...


class Notifier(Protocol):
    """Cross-replica signals (e.g. PostgreSQL LISTEN/NOTIFY on one connection per
    process). The store sends them after its commits; this side receives them, for the
    sessions it follows, and heals what it missed by reading their stored sequence."""

    def follow(self, session_id: str) -> None:
        """Deliver ``session_id``'s events from now on (a stream here follows it)."""
        ...

    def unfollow(self, session_id: str) -> None:
        """Stop delivering ``session_id``'s events (no stream here follows it)."""
        ...

    async def start(
        self,
        on_events: Callable[[str, int], Awaitable[None] | None],
        on_cancel: Callable[[str], Awaitable[None] | None],
        on_resync: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        """Start delivering ``(session_id, last_sequence)`` of events of followed sessions
        committed by other replicas (``last_sequence`` -1: the session was deleted; the
        same pair may come again, and as a heal for events this replica stored), and
        turn ids whose cancel was requested (on any replica, this one included).

        ``on_resync`` is called after the notifier reconnected: notifications sent while
        it was disconnected are lost, and it cannot know which sessions they named, so
        the receiver re-reads every session it follows (e.g. ``Hub.resync``).
        """
        ...

    async def stop(self) -> None: ...
