"""The tool backends over gRPC: tracker, skills and knowledge clients acting for a human.

``GrpcToolBackends`` implements the core's ``ToolBackends`` port (``service/core/ports.py``)
on ``grpc.aio`` channels to ``ballet.tracker.v1.TrackerService``,
``ballet.skills.v1.SkillsService`` and ``ballet.knowledge.v1.KnowledgeService``.

Authority (seed: Authority; SPEC section 4): every call carries the human's bearer token
(``authorization``), the recorded actor (``x-ballet-actor: planner:<session_id>``) and the
planner's own service credential (``x-ballet-service-authorization``), so a backend can
honour the actor only when the caller proves it is the planner, and authorizes the human.

Deadlines (SPEC section 5, Deadlines): every call has the deadline the caller passes in
seconds; it never comes from an inbound RPC, because a turn outlives the RPC that started
it.

Errors (STYLE rules 5 and 6): an upstream ``grpc.aio.AioRpcError`` is parsed once, in
``upstream_error``, and translated by one of two tables: ``tool_failure`` for tool calls
(the model gets an error result) and ``_project_error``/``_skill_error`` for the system
prompt's reads (domain ``PlannerError``s the transport maps to status codes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import grpc
from ballet.skills.v1 import skills_pb2, skills_pb2_grpc
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from service.core.errors import (
    NotFound,
    PlannerError,
    ToolFailure,
    Unauthenticated,
    Unavailable,
)
from service.core.ports import Acting, BackendCall, BackendResult, ProjectInfo, SkillDocument

#: Metadata key of the recorded actor, ``planner:<session_id>`` (SPEC section 4).
ACTOR_HEADER = "x-ballet-actor"
#: Metadata key of the planner's own service credential (SPEC section 4).
SERVICE_AUTHORIZATION_HEADER = "x-ballet-service-authorization"
#: Project settings the planner reads (seed: Instructions; SPEC section 5 step 2, 4).
PLANNER_SKILL_SETTING = "planner.skill"
MODEL_CREDENTIAL_SETTING = "planner.model_credential"

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class UpstreamError:
    """A failed backend RPC: its status code, message and ``ErrorInfo`` reason (AIP-193;
    empty when the backend sent none)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""


def upstream_error(error: grpc.aio.AioRpcError) -> UpstreamError:
    """Parse a failed RPC once: code, details and the first ``ErrorInfo`` reason found in
    the ``google.rpc.Status`` of the trailing metadata (``grpc-status-details-bin``)."""
    reason = ""
    for key, value in error.trailing_metadata() or ():
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # a malformed detail must not hide the status code itself
            break
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reason = info.reason
                break
        break
    return UpstreamError(code=error.code(), message=error.details() or "", reason=reason)


# The one table from a backend's status to a tool call's error result (SPEC section 5
# step 5: "any failure ... becomes an error result for the model"). INVALID_ARGUMENT and
# FAILED_PRECONDITION keep the backend's message, since it tells the model what to fix.
_TOOL_REASONS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.PERMISSION_DENIED: "PERMISSION_DENIED",
    grpc.StatusCode.NOT_FOUND: "NOT_FOUND",
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_ARGUMENTS",
    grpc.StatusCode.FAILED_PRECONDITION: "INVALID_ARGUMENTS",
    grpc.StatusCode.OUT_OF_RANGE: "INVALID_ARGUMENTS",
    grpc.StatusCode.UNAVAILABLE: "BACKEND_UNAVAILABLE",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    grpc.StatusCode.ALREADY_EXISTS: "CONFLICT",
}


def tool_failure(error: UpstreamError) -> ToolFailure:
    """Translate a backend's refusal into the ``ToolFailure`` the model sees.

    ``ABORTED`` is ``STALE_VERSION`` (a knowledge update sent an old version; SPEC section
    9), or ``CONFLICT`` when the backend's ``ErrorInfo`` names another race;
    ``UNAUTHENTICATED`` with reason ``TOKEN_EXPIRED`` is ``CREDENTIAL_EXPIRED``, which ends
    the turn ``FAILED`` at the end of the round (SPEC section 4); anything unexpected is
    ``BACKEND_ERROR``.
    """
    code = error.code
    if code == grpc.StatusCode.ABORTED:
        conflict = error.reason not in ("", "STALE_VERSION", "VERSION_MISMATCH", "ABORTED")
        reason = "CONFLICT" if conflict else "STALE_VERSION"
        message = error.message or "the entry changed since it was read; read it again"
        return ToolFailure(reason, message)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if error.reason == "TOKEN_EXPIRED":
            return ToolFailure("CREDENTIAL_EXPIRED", "the human's credential has expired")
        return ToolFailure("BACKEND_ERROR", "the backend refused the planner's credentials")
    reason = _TOOL_REASONS.get(code, "BACKEND_ERROR")
    if reason == "BACKEND_UNAVAILABLE":
        return ToolFailure(reason, "the backend is unavailable; try again later")
    if reason == "DEADLINE_EXCEEDED":
        return ToolFailure(reason, "the backend did not answer in time")
    if reason == "BACKEND_ERROR":
        return ToolFailure(reason, f"the backend failed ({code.name})")
    return ToolFailure(reason, error.message or reason.lower().replace("_", " "))


def _project_error(error: UpstreamError, project_id: str) -> PlannerError:
    # NOT_FOUND and PERMISSION_DENIED look the same, so existence does not leak (SPEC 4).
    if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return NotFound(f"project {project_id!r} not found", reason="PROJECT_NOT_FOUND")
    if error.code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(
            "the tracker refused the token", reason=error.reason or None
        )
    # Anything else means the project cannot be fetched: SPEC section 5 step 2.
    return Unavailable(
        f"the tracker backend failed ({error.code.name})", reason="DEPENDENCY_UNAVAILABLE"
    )


def _skill_error(error: UpstreamError, name: str) -> PlannerError:
    if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return NotFound(f"skill {name!r} not found", reason="SKILL_NOT_FOUND")
    if error.code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated("the skills backend refused the token", reason=error.reason or None)
    return Unavailable(
        f"the skills backend failed ({error.code.name})", reason="DEPENDENCY_UNAVAILABLE"
    )


class GrpcToolBackends:
    """``ToolBackends`` over gRPC (see the module docstring for authority and deadlines).

    ``tracker``, ``skills`` and ``knowledge`` are ``grpc.aio`` channels (made by
    ``service.adapters.channels.make_channel``; the caller owns and closes them).
    ``service_token`` returns the planner's current service credential; it is called for
    every RPC, so a rotated credential is picked up without a restart.
    """

    def __init__(
        self,
        *,
        tracker: grpc.aio.Channel,
        skills: grpc.aio.Channel,
        knowledge: grpc.aio.Channel,
        service_token: Callable[[], str],
    ) -> None:
        # The stubs' overloads pick the async type from an aio channel; grpc has no type
        # information here, so say which one it is.
        self._tracker = cast(
            "tracker_pb2_grpc.TrackerServiceAsyncStub", tracker_pb2_grpc.TrackerServiceStub(tracker)
        )
        self._skills = cast(
            "skills_pb2_grpc.SkillsServiceAsyncStub", skills_pb2_grpc.SkillsServiceStub(skills)
        )
        self._knowledge_channel = knowledge
        self._service_token = service_token

    def _metadata(self, acting: Acting) -> tuple[tuple[str, str], ...]:
        return (
            ("authorization", f"Bearer {acting.token}"),
            (ACTOR_HEADER, acting.actor),
            (SERVICE_AUTHORIZATION_HEADER, f"Bearer {self._service_token()}"),
        )

    async def get_project(self, acting: Acting, project_id: str, timeout_s: float) -> ProjectInfo:
        """``TrackerService.GetProject`` as the human, within ``timeout_s`` seconds.

        Returns the project with its ``planner.skill`` and ``planner.model_credential``
        settings (empty when unset) and the human's permissions in it. Raises ``NotFound``
        (``PROJECT_NOT_FOUND``: unknown, or not readable by the human; SPEC section 4),
        ``Unauthenticated`` (the tracker refused the token; its reason, e.g.
        ``TOKEN_EXPIRED``, is kept), ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``: down,
        too slow, or failed; SPEC section 5 step 2).
        """
        request = tracker_pb2.GetProjectRequest(project_id=project_id)
        try:
            response = await self._tracker.GetProject(
                request, metadata=self._metadata(acting), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise _project_error(upstream_error(error), project_id) from None
        project = response.project
        return ProjectInfo(
            project_id=project.project_id,
            name=project.name,
            description=project.description,
            organization_id=project.organization_id,
            organization_name=project.organization_name,
            planner_skill=project.settings.get(PLANNER_SKILL_SETTING, ""),
            model_credential=project.settings.get(MODEL_CREDENTIAL_SETTING, ""),
            permissions=frozenset(response.permissions),
        )

    async def read_skill(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> SkillDocument:
        """``SkillsService.ReadSkill``: SKILL.md of ``name`` in the version the project
        resolves, pins applied (seed: Instructions), within ``timeout_s`` seconds.

        Raises ``NotFound`` (``SKILL_NOT_FOUND``: unknown, or not readable by the human),
        ``Unauthenticated``, ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``).
        """
        request = skills_pb2.ReadSkillRequest(project_id=project_id, name=name)
        try:
            response = await self._skills.ReadSkill(
                request, metadata=self._metadata(acting), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise _skill_error(upstream_error(error), name) from None
        return SkillDocument(
            name=response.skill.name or name,
            version=response.skill.version,
            content=response.content,
        )

    async def invoke(self, call: BackendCall) -> BackendResult:
        """Run one tool against its backend (the tools follow in the next change)."""
        raise ToolFailure("UNKNOWN_TOOL", f"no backend for tool {call.tool!r}")
