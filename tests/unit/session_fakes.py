"""Small in-memory fakes for the session rules: a clock and a tracker (the store is the
one in-memory store, tests/memory_store.py). The integration and service tiers run the
same rules on the SQL store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from service.core.errors import NotFound
from service.core.ports import Acting, ProjectInfo

START = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class ManualClock:
    """A clock the test moves: ``now`` moves only by hand; ``monotonic`` is the machine's
    monotonic seconds plus every move, so deadlines the core waits for still pass."""

    def __init__(self) -> None:
        self.current = self._start = START

    def now(self) -> datetime:
        return self.current

    def monotonic(self) -> float:
        return time.monotonic() + (self.current - self._start).total_seconds()

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


@dataclass
class FakeTracker:
    """``ToolBackends.get_project``: which humans may read which projects, by org."""

    readable: dict[tuple[str, str], str] = field(default_factory=dict)
    calls: list[tuple[Acting, str]] = field(default_factory=list)

    def allow(self, human: str, project: str, organization: str = "acme") -> None:
        self.readable[(human, project)] = organization

    async def get_project(self, acting: Acting, project_id: str, timeout_s: float) -> ProjectInfo:
        self.calls.append((acting, project_id))
        organization = self.readable.get((acting.human_id, project_id))
        if organization is None:
            raise NotFound("no such project", reason="PROJECT_NOT_FOUND")
        return ProjectInfo(
            project_id=project_id,
            name=project_id.title(),
            description="",
            organization_id=organization,
            organization_name=organization.title(),
            planner_skill="",
            model_credential="cred",
        )

    async def read_skill(self, *args: object) -> object:
        raise NotImplementedError
