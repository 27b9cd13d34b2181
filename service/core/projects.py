"""The project directory: what the tracker and the skills backend say about a project, as
one human sees it, cached once for every reader in the process.

Session access checks (``service.core.sessions.ProjectAccess``) and turn prompts
(``service.core.turn.prompt.PromptSource``) read projects here, so a human's project is
asked of the tracker once per ``cache_s`` seconds whichever of them asks first.

Answers are kept per (organization, human, project): a token of the same subject in
another organization never reuses an answer given for this one. Only answers are cached;
refusals and failures (``NotFound``, ``Unauthenticated``, ``Unavailable``) are not, so a
new permission works at once and a revoked one is seen within ``cache_s``.
"""

from __future__ import annotations

from collections import OrderedDict

from service.core.errors import NotFound
from service.core.ports.backends import Acting, ProjectInfo, SkillDocument, ToolBackends
from service.core.ports.clock import Clock

#: Answers kept at most (least recently used dropped first): a bound on memory.
PROJECT_CACHE_MAX_ENTRIES = 10_000
#: The longest a positive answer is reused, in seconds, whatever ``cache_s`` says.
PROJECT_CACHE_MAX_S = 60.0

_Key = tuple[str, str, str, str]


class ProjectDirectory:
    """Projects and their skills read through ``backends`` as the acting human, each call
    within ``timeout_s`` seconds, positive answers reused ``cache_s`` seconds (at most 60;
    0 turns the cache off) on ``clock``'s monotonic time, at most ``max_entries`` kept.
    """

    def __init__(
        self,
        backends: ToolBackends,
        clock: Clock,
        *,
        cache_s: float = PROJECT_CACHE_MAX_S,
        timeout_s: float = 5.0,
        max_entries: int = PROJECT_CACHE_MAX_ENTRIES,
    ) -> None:
        self._backends = backends
        self._clock = clock
        self._cache_s = min(cache_s, PROJECT_CACHE_MAX_S)
        self._timeout_s = timeout_s
        self._max_entries = max_entries
        self._cache: OrderedDict[_Key, tuple[float, ProjectInfo | SkillDocument]] = OrderedDict()

    async def project(self, acting: Acting, project_id: str) -> ProjectInfo:
        """The project with its ``planner.*`` settings and the human's permissions.

        Raises what ``ToolBackends.get_project`` raises: ``NotFound``/``PROJECT_NOT_FOUND``
        (unknown or not readable), ``Unauthenticated``, ``Unavailable``.
        """
        key = ("project", acting.organization_id, acting.human_id, project_id)
        found = self._cached(key)
        if isinstance(found, ProjectInfo):
            return found
        try:
            project = await self._backends.get_project(acting, project_id, self._timeout_s)
        except NotFound:
            self._cache.pop(key, None)
            raise
        self._keep(key, project)
        return project

    async def skill(self, acting: Acting, project_id: str, name: str) -> SkillDocument:
        """The skill ``name`` in the version ``project_id`` resolves.

        Raises what ``ToolBackends.read_skill`` raises: ``NotFound``/``SKILL_NOT_FOUND``,
        ``Unauthenticated``, ``Unavailable``.
        """
        key = (f"skill:{name}", acting.organization_id, acting.human_id, project_id)
        found = self._cached(key)
        if isinstance(found, SkillDocument):
            return found
        skill = await self._backends.read_skill(acting, project_id, name, self._timeout_s)
        self._keep(key, skill)
        return skill

    def kept_project(self, acting: Acting, project_id: str) -> ProjectInfo | None:
        """The project as ``project`` would answer it from memory now, else None (no
        read, no wait: the early model call, decision 0380)."""
        found = self._cached(("project", acting.organization_id, acting.human_id, project_id))
        return found if isinstance(found, ProjectInfo) else None

    def kept_skill(self, acting: Acting, project_id: str, name: str) -> SkillDocument | None:
        """The skill as ``skill`` would answer it from memory now, else None."""
        key = (f"skill:{name}", acting.organization_id, acting.human_id, project_id)
        found = self._cached(key)
        return found if isinstance(found, SkillDocument) else None

    def _cached(self, key: _Key) -> ProjectInfo | SkillDocument | None:
        hit = self._cache.get(key)
        if hit is None or hit[0] <= self._clock.monotonic():
            return None
        self._cache.move_to_end(key)
        return hit[1]

    def _keep(self, key: _Key, answer: ProjectInfo | SkillDocument) -> None:
        if self._cache_s <= 0:
            return
        self._cache[key] = (self._clock.monotonic() + self._cache_s, answer)
        self._cache.move_to_end(key)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
