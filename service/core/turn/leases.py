"""Turn ownership (docs/spec/turn-loop.md, Ownership and recovery; decision 0070).

A running turn records the replica that owns it and a lease the owner renews every third
of ``lease_s``. A sweeper on every replica closes turns whose lease expired
``INTERRUPTED`` from what is stored; the one-running-turn rule counts only turns whose
lease holds. A renewal that finds the turn gone or taken over stops its run without
storing anything more; one that finds a cancel flag (a notification missed while the
listener reconnected) stops it ``CANCELLED``.

A sweeper that could not reach the database itself closes nothing for ``lease_s`` after
it answers again (decision 0371): the leases that expired meanwhile belong to owners who
may only have lost the database too, and who, being alive, renew them or store their
turns' ends (what their humans saw) within that time. A replica cut alone from the
database (its peers still reach it) is swept as before: its peers saw no outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import timedelta

from service.core.errors import StoreUnavailable
from service.core.turn import ending as endings
from service.core.turn.ending import OnPromoted, close_stored_turn
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import TurnHandle

log = logging.getLogger(__name__)


class Leases:
    """Renews the leases of this replica's turns (``handles``, by turn id) and sweeps
    every replica's expired ones."""

    def __init__(
        self,
        deps: TurnDependencies,
        handles: Mapping[str, TurnHandle],
        on_promoted: OnPromoted | None = None,
    ) -> None:
        self._deps = deps
        self._handles = handles
        self._on_promoted = on_promoted
        self._tasks: list[asyncio.Task[None]] = []
        # The sweeper's own view of the database (decision 0371): a sweep failed since
        # the last answer; no closing before this monotonic time.
        self._unanswered = False
        self._hold_until = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._renew_loop(), name="turn-lease-renewer"),
            loop.create_task(self._sweep_loop(), name="turn-sweeper"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def sweep(self) -> int:
        """Close every running turn whose lease expired and that no run here holds;
        returns how many this call closed (replicas race for the same turns; one wins
        each). Closes nothing for ``lease_s`` after a failed sweep's database answers
        again (see the module docstring). Raises ``StoreUnavailable``."""
        deps = self._deps
        now = deps.clock.now()
        closed = 0
        try:
            expired = await deps.store.running_turns(lease_expired_before=now)
        except StoreUnavailable:
            self._unanswered = True
            raise
        if self._unanswered:
            # Back from an outage of our own: the owners get a lease's length to renew.
            self._unanswered = False
            self._hold_until = deps.clock.monotonic() + deps.settings.lease_s
            log.info(
                "the database answers again: expired leases are swept after %g s",
                deps.settings.lease_s,
            )
        if deps.clock.monotonic() < self._hold_until:
            return 0
        for turn in expired:
            if turn.turn_id in self._handles:
                continue
            if await close_stored_turn(
                deps.store,
                deps.hub,
                deps.clock,
                deps.observer,
                turn,
                endings.LEASE_EXPIRED,
                lease_expired_before=now,
                promote=endings.promotion(deps),
                on_promoted=self._on_promoted,
            ):
                closed += 1
        return closed

    async def renew(self) -> None:
        """Renew every lease this replica holds once."""
        deps = self._deps
        for handle in list(self._handles.values()):
            if handle.done.is_set():
                continue
            until = deps.clock.now() + timedelta(seconds=deps.settings.lease_s)
            try:
                status = await deps.store.renew_lease(handle.turn_id, deps.replica_id, until)
            except StoreUnavailable:
                continue
            if not status.held:
                # Another replica closed it: the run's next commit conflicts and stores
                # nothing more.
                handle.request_stop(endings.TAKEN_OVER)
            elif status.cancel_requested:
                handle.request_stop(endings.cancel_ending(status.cancel_reason))
            elif status.join_pending:
                handle.join_pending = True

    async def _renew_loop(self) -> None:
        interval = self._deps.settings.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self.renew()
            except Exception as error:
                log.error("lease renewal failed: %s", type(error).__name__)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._deps.settings.sweep_interval_s)
            try:
                await self.sweep()
            except StoreUnavailable:
                continue
            except Exception as error:
                log.error("sweeping expired turns failed: %s", type(error).__name__)
