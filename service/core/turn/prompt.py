"""The fixed part of a turn's model requests (docs/spec/turn-loop.md step
2).

The system prompt is the built-in instructions, the project and organization, and the
SKILL.md of the project's planner skill in the version the project resolves. The project
and the skill are read as the human (their access decides what the planner may show) and
kept for at most ``ttl_s`` seconds in one cache keyed by organization, human and project,
on the injected clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.core import prompts
from service.core.context import build_system_prompt
from service.core.estimate import MESSAGE_OVERHEAD_TOKENS, declarations_tokens, text_tokens
from service.core.ports import (
    Acting,
    Clock,
    ProjectInfo,
    SkillDocument,
    ToolBackends,
    ToolDeclaration,
    TurnPatch,
)
from service.core.tools import TOOL_SCHEMA_VERSION

#: Entries kept before expired ones are dropped (a bound on memory, not a policy).
_MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Prompt:
    """One turn's fixed request parts: the system prompt, what it was built from, and
    its estimated size with the tool declarations in tokens (``fixed_tokens``, for the
    context estimate: docs/spec/compaction.md counts it whenever no usage is known). ``versions`` is
    what the turn records (docs/spec/turn-loop.md step 2)."""

    system: str
    project: ProjectInfo
    skill: SkillDocument | None
    fixed_tokens: int
    versions: TurnPatch

    @property
    def credential_ref(self) -> str:
        """The project's model credential reference (never a secret; docs/spec/turn-loop.md step
        4)."""
        return self.project.model_credential


class PromptSource:
    """Builds ``Prompt``s, reading the project and the planner skill through
    ``backends`` within ``timeout_s`` seconds each, cached ``ttl_s`` seconds."""

    def __init__(
        self,
        backends: ToolBackends,
        clock: Clock,
        *,
        model: str,
        declarations: Sequence[ToolDeclaration],
        ttl_s: float,
        timeout_s: float,
    ) -> None:
        self._backends = backends
        self._clock = clock
        self._model = model
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._declarations_tokens = declarations_tokens(declarations)
        self._cache: dict[tuple[str, str, str], tuple[float, Prompt]] = {}

    async def prompt(self, acting: Acting, project_id: str) -> Prompt:
        """The prompt for a turn of ``acting`` in ``project_id``.

        Raises what ``ToolBackends.get_project`` and ``read_skill`` raise (``NotFound``,
        ``Unavailable``, ``Unauthenticated``): the turn then ends
        ``FAILED``/``DEPENDENCY_UNAVAILABLE`` before any model call.
        """
        key = (acting.organization_id, acting.human_id, project_id)
        now = self._clock.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        prompt = await self._build(acting, project_id)
        if len(self._cache) >= _MAX_ENTRIES:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[key] = (now + self._ttl_s, prompt)
        return prompt

    async def _build(self, acting: Acting, project_id: str) -> Prompt:
        project = await self._backends.get_project(acting, project_id, self._timeout_s)
        skill: SkillDocument | None = None
        if project.planner_skill:
            skill = await self._backends.read_skill(
                acting, project_id, project.planner_skill, self._timeout_s
            )
        system = build_system_prompt(project, skill)
        return Prompt(
            system=system,
            project=project,
            skill=skill,
            fixed_tokens=MESSAGE_OVERHEAD_TOKENS + text_tokens(system) + self._declarations_tokens,
            versions=TurnPatch(
                instructions_version=prompts.INSTRUCTIONS_VERSION,
                tool_schema_version=TOOL_SCHEMA_VERSION,
                skill_name=skill.name if skill else "",
                skill_version=skill.version if skill else "",
                model=self._model,
            ),
        )
