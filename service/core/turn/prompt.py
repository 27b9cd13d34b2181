"""The fixed part of a turn's model requests (docs/spec/turn-loop.md).

The system prompt is the built-in instructions, the project and organization, and the
SKILL.md of the project's planner skill in the version the project resolves. The project
and the skill are read as the human (their access decides what the planner may show)
through the process's one ``ProjectDirectory`` (``service.core.projects``), which the
session access checks share.

The instructions go first, before the tools, and are the same for every project; the
project block goes after the tools as system-side context (``ModelRequest.system_context``),
so a provider's prefix cache of instructions and tools is shared by every project, and
the whole fixed prefix by every turn and session of one project (decision 0296).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from service.core import prompts
from service.core.context import project_block
from service.core.estimate import MESSAGE_OVERHEAD_TOKENS, declarations_tokens, text_tokens
from service.core.ports import Acting, ProjectInfo, SkillDocument, ToolDeclaration, TurnPatch
from service.core.projects import PROJECT_CACHE_MAX_ENTRIES, ProjectDirectory
from service.core.tools import TOOL_SCHEMA_VERSION


@dataclass(frozen=True)
class Prompt:
    """One turn's fixed request parts: the system prompt (``system``: the built-in
    instructions, the same for every project) and the project block (``context``: the
    project, organization and planner skill), what they were built from, and their
    estimated size with the tool declarations in tokens (``fixed_tokens``, for the
    context estimate: docs/spec/compaction.md counts it whenever no usage is known).
    ``versions`` is what the turn records (docs/spec/turn-loop.md step 2)."""

    system: str
    context: str
    project: ProjectInfo
    skill: SkillDocument | None
    fixed_tokens: int
    versions: TurnPatch

    @property
    def credential_ref(self) -> str:
        """The project's model credential reference (never a secret; docs/spec/turn-loop.md step
        4)."""
        return self.project.model_credential


@dataclass(frozen=True)
class SharedPrefix:
    """What every model request of every project starts with: the system prompt (the
    built-in instructions of ``prompts.INSTRUCTIONS_VERSION``) and the tool declarations,
    and their estimated size in tokens (``tokens``: one message's overhead, the text,
    and ``declarations_tokens``)."""

    system: str
    tokens: int


def shared_prefix(declarations: Sequence[ToolDeclaration]) -> SharedPrefix:
    """The rendered prefix every project shares, and its estimated tokens: the part of
    the fixed prompt known before any project is (for the start-up budget check). A
    turn's fixed prompt adds its project block, ``Prompt.fixed_tokens``."""
    system = prompts.instructions()
    tokens = MESSAGE_OVERHEAD_TOKENS + text_tokens(system) + declarations_tokens(declarations)
    return SharedPrefix(system=system, tokens=tokens)


class PromptSource:
    """Builds ``Prompt``s from the project and its planner skill as the process's
    ``ProjectDirectory`` gives them (read as the human, cached there, the same answers
    the session access checks see). A prompt is rendered and estimated once per answer
    of the directory and reused while the directory gives the same answer (decision
    0342); at most ``max_built`` are kept, least recently used dropped first."""

    def __init__(
        self,
        directory: ProjectDirectory,
        *,
        model: str,
        declarations: Sequence[ToolDeclaration],
        max_built: int = PROJECT_CACHE_MAX_ENTRIES,
    ) -> None:
        self._directory = directory
        self._model = model
        self._shared = shared_prefix(declarations)
        # The prompt last built per directory entry, with the answers it was built from:
        # reused while the directory gives the same answers (the same objects), rebuilt
        # when an entry was read again (decision 0342). Bounded like the directory.
        self._built: OrderedDict[
            tuple[str, str, str], tuple[ProjectInfo, SkillDocument | None, Prompt]
        ] = OrderedDict()
        self._max_built = max_built

    async def prompt(self, acting: Acting, project_id: str) -> Prompt:
        """The prompt for a turn of ``acting`` in ``project_id``.

        Raises what ``ToolBackends.get_project`` and ``read_skill`` raise (``NotFound``,
        ``Unavailable``, ``Unauthenticated``): the turn then ends
        ``FAILED``/``DEPENDENCY_UNAVAILABLE`` before any model call.
        """
        project = await self._directory.project(acting, project_id)
        skill: SkillDocument | None = None
        if project.planner_skill:
            skill = await self._directory.skill(acting, project_id, project.planner_skill)
        key = (acting.organization_id, acting.human_id, project_id)
        built = self._built.get(key)
        if built is not None and built[0] is project and built[1] is skill:
            self._built.move_to_end(key)
            return built[2]
        prompt = self._build(project, skill)
        self._built[key] = (project, skill, prompt)
        self._built.move_to_end(key)
        while len(self._built) > self._max_built:
            self._built.popitem(last=False)
        return prompt

    def kept(self, acting: Acting, project_id: str) -> Prompt | None:
        """The prompt ``prompt`` would give now, when it needs no read and no rendering:
        the directory's answers are in memory and the prompt built from them is kept;
        else None. Never waits (the early model call, decision 0380)."""
        project = self._directory.kept_project(acting, project_id)
        if project is None:
            return None
        skill: SkillDocument | None = None
        if project.planner_skill:
            skill = self._directory.kept_skill(acting, project_id, project.planner_skill)
            if skill is None:
                return None
        built = self._built.get((acting.organization_id, acting.human_id, project_id))
        if built is not None and built[0] is project and built[1] is skill:
            return built[2]
        return None

    def _build(self, project: ProjectInfo, skill: SkillDocument | None) -> Prompt:
        context = project_block(project, skill)
        return Prompt(
            system=self._shared.system,
            context=context,
            project=project,
            skill=skill,
            fixed_tokens=self._shared.tokens + MESSAGE_OVERHEAD_TOKENS + text_tokens(context),
            versions=TurnPatch(
                instructions_version=prompts.INSTRUCTIONS_VERSION,
                tool_schema_version=TOOL_SCHEMA_VERSION,
                skill_name=skill.name if skill else "",
                skill_version=skill.version if skill else "",
                model=self._model,
            ),
        )
