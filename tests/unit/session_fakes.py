"""Small in-memory fakes for the session rules: a tracker (the clock is
``tests.unit.fakes.FakeClock``, the store the one in-memory store, tests/memory_store.py).
The integration and service tiers run the same rules on the SQL store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.errors import NotFound
from service.core.ports import Acting, ProjectInfo


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
