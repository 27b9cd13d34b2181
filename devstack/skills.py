"""The devstack's ``ballet.skills.v1.SkillsService``: a project's effective skills.

Both RPCs need ``skill.read`` in the project (docs/spec/turn-loop.md, list_skills / read_skill).
"""

from __future__ import annotations

from typing import Any

import grpc
from ballet.skills.v1 import skills_pb2, skills_pb2_grpc

from devstack.auth import SKILL_READ, Caller
from devstack.errors import InvalidArgument
from devstack.pages import PageTokens, page_size
from devstack.rpc import Backend
from devstack.store import Store
from devstack.store import skills as skills_store
from devstack.store.access import project_access, require
from devstack.store.records import SkillView

SERVICE = "ballet.skills.v1.SkillsService"
DOMAIN = "skills.ballet"
LIST_DEFAULT, LIST_MAX = 50, 200

_SCOPES = {
    "organization": skills_pb2.SKILL_SCOPE_ORGANIZATION,
    "project": skills_pb2.SKILL_SCOPE_PROJECT,
}


def skill_message(skill: SkillView) -> skills_pb2.Skill:
    """The proto of a skill as the project resolves it."""
    return skills_pb2.Skill(
        name=skill.name,
        description=skill.description,
        scope=_SCOPES[skill.scope],
        version=skill.version,
        pinned=skill.pinned,
        latest_version=skill.latest_version,
    )


class SkillsServicer(skills_pb2_grpc.SkillsServiceServicer):
    """The skills backend over the devstack store."""

    def __init__(self, store: Store, backend: Backend, pages: PageTokens) -> None:
        self._store = store
        self._rpc = backend
        self._pages = pages

    async def ListSkills(
        self, request: skills_pb2.ListSkillsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> skills_pb2.ListSkillsResponse:
        """A page of the project's effective skills by name (AIP-158); needs skill.read."""

        async def work(caller: Caller) -> skills_pb2.ListSkillsResponse:
            size = page_size(request.page_size, default=LIST_DEFAULT, maximum=LIST_MAX)
            filters = {"project": request.project_id}
            position = self._pages.decode_page(request.page_token, "ListSkills", filters)
            after = str(position["n"]) if position else None
            async with self._store.read() as session:
                access = await project_access(
                    session,
                    human=caller.human,
                    organization_id=caller.organization_id,
                    project_id=request.project_id,
                )
                require(access.permissions, SKILL_READ, where=f"project {request.project_id}")
                views = await skills_store.effective_skills(
                    session,
                    org_id=access.project.organization_id,
                    project_id=request.project_id,
                )
            remaining = [view for view in views if after is None or view.name > after]
            page = remaining[:size]
            token = ""
            if len(remaining) > size:
                token = self._pages.encode("ListSkills", filters, {"n": page[-1].name})
            return skills_pb2.ListSkillsResponse(
                skills=[skill_message(view) for view in page], next_page_token=token
            )

        return await self._rpc.run(context, "ListSkills", work, project_id=request.project_id)

    async def ReadSkill(
        self, request: skills_pb2.ReadSkillRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> skills_pb2.ReadSkillResponse:
        """The SKILL.md of the version the project resolves (its pin, else the latest);
        needs skill.read; NOT_FOUND (SKILL_NOT_FOUND) for a name the project lacks."""

        async def work(caller: Caller) -> skills_pb2.ReadSkillResponse:
            if not request.name:
                raise InvalidArgument("NAME_REQUIRED", "name is required")
            async with self._store.read() as session:
                access = await project_access(
                    session,
                    human=caller.human,
                    organization_id=caller.organization_id,
                    project_id=request.project_id,
                )
                require(access.permissions, SKILL_READ, where=f"project {request.project_id}")
                view = await skills_store.read_skill(
                    session,
                    org_id=access.project.organization_id,
                    project_id=request.project_id,
                    name=request.name,
                )
            return skills_pb2.ReadSkillResponse(skill=skill_message(view), content=view.content)

        return await self._rpc.run(context, "ReadSkill", work, project_id=request.project_id)
