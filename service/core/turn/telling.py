"""Store, then tell: the one owner of what follows a turn's commit (docs/spec/turn-loop.md,
docs/spec/api-and-streams.md; decision 0330).

A commit of a turn is applied first; only what the store returns (numbered, as stored) is
told, to this process's streams (``Hub.publish``) and, when the commit ended the turn,
to the metrics (``TurnObserver.turn_ended``, once per ending). Every path that commits
for a turn goes through here: the loop's rounds, results, compactions and its end, the
close of a stored turn (sweeper, start-up, shutdown, a lost database), the start of a
turn. So a stream never sees an event the store may still refuse, and the ending counts
the same whichever way the turn ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.core.fanout import Hub
from service.core.model import EventKind, SessionEvent, Turn, TurnEndedData
from service.core.ports import Promotion, SessionStore, TurnCommit, TurnEnd
from service.core.turn.settings import TurnDependencies, TurnObserver


@dataclass(frozen=True)
class StoreThenTell:
    """Commits a turn's events and tells what was stored. Build one with ``of(deps)`` or
    from the parts a caller holds."""

    store: SessionStore
    hub: Hub
    observer: TurnObserver

    @classmethod
    def of(cls, deps: TurnDependencies) -> StoreThenTell:
        """The store, hub and observer of ``deps``."""
        return cls(deps.store, deps.hub, deps.observer)

    async def commit(self, commit: TurnCommit, turn: Turn) -> list[SessionEvent]:
        """Apply ``commit`` (of ``turn``), then ``tell`` what it stored; returns the
        stored events. Raises what ``SessionStore.commit`` raises (``StoreConflict``,
        ``StoreUnavailable``), and then nothing is told."""
        stored = await self.store.commit(commit)
        self.tell(stored, turn)
        return stored

    async def end(self, commit: TurnCommit, turn: Turn, promotion: Promotion) -> TurnEnd:
        """Apply the ending ``commit`` of ``turn`` with ``promotion``
        (``SessionStore.end_turn``: the session's next queued turn starts in the same
        transaction; decision 0300), then tell the ending and, after it, the promoted
        turn's start. Raises as ``commit``."""
        end = await self.store.end_turn(commit, promotion)
        self.tell(end.events, turn)
        if end.promoted is not None:
            self.tell(end.promoted.events, end.promoted.turn)
        return end

    def tell(self, stored: Sequence[SessionEvent], turn: Turn) -> None:
        """Tell what a commit of ``turn`` stored: a ``turn_ended`` among ``stored`` is
        counted (reason, ErrorInfo reason, rounds, and seconds from the turn's
        ``start_time`` to the ending's ``create_time``), then every event is published to
        this process's streams. Call it after the commit, never before, and only for what
        the store returned."""
        for event in stored:
            if event.kind is EventKind.TURN_ENDED and isinstance(event.data, TurnEndedData):
                ended = event.data
                seconds = (event.create_time - turn.start_time).total_seconds()
                self.observer.turn_ended(
                    ended.reason, ended.error_reason, ended.rounds, max(0.0, seconds)
                )
        self.hub.publish(list(stored))
