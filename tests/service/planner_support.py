"""Helpers for service tests of the planner: a tiny tracker, settings, tokens, status.

``FakeTracker`` is a real ``grpc.aio`` TrackerService on a free loopback port that answers
``GetProject`` and records the metadata of every call, so tests see what the planner
sends as the human (docs/spec/authority.md). Everything else a backend does belongs to the
devstack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc

from ballet_common.grpc.status import parse
from ballet_common.tokens import (
    HUMAN_AUDIENCES,
    PLANNER_AUDIENCE,
    dev_secret,
    mint_dev_service_token,
    mint_dev_token,
)
from service.config import SHUTDOWN_OVERHEAD_S, Settings, load_settings


@dataclass
class TrackerCall:
    """What the planner sent with one GetProject: project and metadata."""

    project_id: str
    metadata: dict[str, str]


@dataclass
class FakeTracker(tracker_pb2_grpc.TrackerServiceServicer):  # type: ignore[misc]
    """GetProject for ``projects``: project id -> (organization, humans who may read)."""

    projects: dict[str, tuple[str, set[str]]] = field(default_factory=dict)
    calls: list[TrackerCall] = field(default_factory=list)
    server: Any = None
    address: str = ""

    async def GetProject(
        self, request: tracker_pb2.GetProjectRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tracker_pb2.GetProjectResponse:
        metadata = {
            key: value for key, value in context.invocation_metadata() if isinstance(value, str)
        }
        self.calls.append(TrackerCall(request.project_id, metadata))
        token = metadata.get("authorization", "").removeprefix("Bearer ")
        human = _unverified_subject(token)
        known = self.projects.get(request.project_id)
        if known is None or human not in known[1]:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such project")
        organization = known[0]  # type: ignore[index]
        return tracker_pb2.GetProjectResponse(
            project=tracker_pb2.Project(
                project_id=request.project_id,
                name=request.project_id.title(),
                organization_id=organization,
                organization_name=organization.title(),
            ),
            permissions=["tracker.read"],
        )

    async def start(self) -> str:
        self.server = grpc.aio.server()
        tracker_pb2_grpc.add_TrackerServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        await self.server.stop(0)


def _unverified_subject(token: str) -> str:
    import jwt

    try:
        return str(jwt.decode(token, options={"verify_signature": False}).get("sub", ""))
    except jwt.PyJWTError:
        return ""


def planner_settings(
    data_dir: Path, tracker_address: str, database_url: str = "", **extra: str
) -> Settings:
    """Settings of a planner on free loopback ports, with every dependency at the tracker."""
    environ = {
        "BALLET_PLANNER__DATA_DIR": str(data_dir),
        "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
        "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "127.0.0.1:0",
        # The least grace the default cancel_grace allows (decision 0181); tests stop
        # their planners with a grace of their own.
        "BALLET_PLANNER__SERVER__GRACE_S": str(
            float(extra.get("PLANNER__CANCEL_GRACE", "5")) + SHUTDOWN_OVERHEAD_S
        ),
        "BALLET_PLANNER__DATABASE__URL": database_url,
    }
    for name in ("TRACKER", "SKILLS", "KNOWLEDGE", "GATEWAY"):
        environ[f"BALLET_PLANNER__DEPENDENCIES__{name}__ADDRESS"] = tracker_address
    environ.update({f"BALLET_PLANNER__{key.upper()}": value for key, value in extra.items()})
    return load_settings(None, environ)


def token(data_dir: Path, user: str, **kw: Any) -> str:
    """A dev token of ``user`` signed with the planner's dev secret."""
    kw.setdefault("audiences", HUMAN_AUDIENCES)
    return mint_dev_token(dev_secret(data_dir), user, **kw)


def service_token(
    data_dir: Path, subject: str, scopes: tuple[str, ...], organization_id: str = "acme"
) -> str:
    """A service principal's dev token for the planner, from the dev service-token
    issuer (the only way to be a service principal; a human token with ``scope`` is
    refused)."""
    return mint_dev_service_token(
        dev_secret(data_dir),
        subject,
        audiences=(PLANNER_AUDIENCE,),
        scopes=scopes,
        organization_id=organization_id,
    )


def auth(bearer: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``bearer``."""
    return (("authorization", f"Bearer {bearer}"),)


def reason_of(error: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a failed call (domain planner.ballet), or ''."""
    failure = parse(error)
    assert not failure.reason or failure.domain == "planner.ballet"
    return failure.reason
