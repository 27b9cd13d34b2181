"""A hostile double of the three tool backends, written from their contracts.

``BackendDouble`` serves ``ballet.tracker.v1.TrackerService``,
``ballet.skills.v1.SkillsService`` and ``ballet.knowledge.v1.KnowledgeService``
(``proto/ballet/*/v1/``) on a real ``grpc.aio`` server on loopback, port 0. Each RPC
answers from a script a test sets (``answer``): a response message, a refusal (any status
code, any message, any ``grpc-status-details-bin`` bytes, well formed or not), bytes that
are not the response message at all, or no answer until the caller gives up. What it
answers is only what the wire allows: proto3 enums are open (an unknown number arrives as
a number), sub-messages and oneofs may be unset, doubles may be NaN or infinite,
``Timestamp`` fields may hold seconds outside any calendar, strings may hold any Unicode
scalar value (NUL included), and a status may come with or without details.

Unscripted, every RPC answers honestly enough for a planner to start a turn:
``GetProject`` gives the project ``demo`` of organization ``acme`` to anyone, the others an
empty response. Every request is recorded with its metadata (``requests``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from ballet.knowledge.v1 import knowledge_pb2
from ballet.skills.v1 import skills_pb2
from ballet.tracker.v1 import tracker_pb2
from google.protobuf.message import Message

_TRACKER = "ballet.tracker.v1.TrackerService"
_SKILLS = "ballet.skills.v1.SkillsService"
_KNOWLEDGE = "ballet.knowledge.v1.KnowledgeService"

#: Every RPC of the three contracts: method -> (service, request type, response type).
METHODS: dict[str, tuple[str, type[Message], type[Message]]] = {
    "GetProject": (_TRACKER, tracker_pb2.GetProjectRequest, tracker_pb2.GetProjectResponse),
    "ListItems": (_TRACKER, tracker_pb2.ListItemsRequest, tracker_pb2.ListItemsResponse),
    "GetItem": (_TRACKER, tracker_pb2.GetItemRequest, tracker_pb2.GetItemResponse),
    "ListRunnableTickets": (
        _TRACKER,
        tracker_pb2.ListRunnableTicketsRequest,
        tracker_pb2.ListRunnableTicketsResponse,
    ),
    "SearchProject": (
        _TRACKER,
        tracker_pb2.SearchProjectRequest,
        tracker_pb2.SearchProjectResponse,
    ),
    "ListChangesets": (
        _TRACKER,
        tracker_pb2.ListChangesetsRequest,
        tracker_pb2.ListChangesetsResponse,
    ),
    "ProposeChangeset": (
        _TRACKER,
        tracker_pb2.ProposeChangesetRequest,
        tracker_pb2.ProposeChangesetResponse,
    ),
    "ListSkills": (_SKILLS, skills_pb2.ListSkillsRequest, skills_pb2.ListSkillsResponse),
    "ReadSkill": (_SKILLS, skills_pb2.ReadSkillRequest, skills_pb2.ReadSkillResponse),
    "SearchKnowledge": (
        _KNOWLEDGE,
        knowledge_pb2.SearchKnowledgeRequest,
        knowledge_pb2.SearchKnowledgeResponse,
    ),
    "GetKnowledgeEntry": (
        _KNOWLEDGE,
        knowledge_pb2.GetKnowledgeEntryRequest,
        knowledge_pb2.GetKnowledgeEntryResponse,
    ),
    "CreateKnowledgeEntry": (
        _KNOWLEDGE,
        knowledge_pb2.CreateKnowledgeEntryRequest,
        knowledge_pb2.CreateKnowledgeEntryResponse,
    ),
    "UpdateKnowledgeEntry": (
        _KNOWLEDGE,
        knowledge_pb2.UpdateKnowledgeEntryRequest,
        knowledge_pb2.UpdateKnowledgeEntryResponse,
    ),
}


@dataclass(frozen=True)
class Refuse:
    """Fail the call with ``code`` and ``message``; ``details``, when set, is sent as
    ``grpc-status-details-bin`` exactly as given (a ``google.rpc.Status``, or garbage)."""

    code: grpc.StatusCode
    message: str = ""
    details: bytes | None = None


@dataclass(frozen=True)
class Raw:
    """Answer with these bytes as the response body, whatever the response type is."""

    data: bytes


@dataclass(frozen=True)
class Park:
    """Never answer; the call ends when the caller's deadline passes or it cancels."""


Answer = Message | Refuse | Raw | Park
#: A scripted answer, or a function of the request that gives one.
Script = Answer | Callable[[Any], Answer]


@dataclass(frozen=True)
class Received:
    """One request the double received: the method, the request and its metadata."""

    method: str
    request: Any
    metadata: dict[str, str]


def demo_project() -> tracker_pb2.GetProjectResponse:
    """The project every unscripted ``GetProject`` returns: ``demo`` of ``acme``, with no
    planner skill and a model credential reference, readable and writable."""
    return tracker_pb2.GetProjectResponse(
        project=tracker_pb2.Project(
            project_id="demo",
            name="Demo",
            organization_id="acme",
            organization_name="Acme",
            settings={"planner.model_credential": "demo-credential"},
        ),
        permissions=[
            "tracker.read",
            "tracker.write",
            "skill.read",
            "knowledge.read",
            "knowledge.write",
        ],
    )


@dataclass
class BackendDouble:
    """The three backends on one server; see the module docstring."""

    scripts: dict[str, Script] = field(default_factory=dict)
    requests: list[Received] = field(default_factory=list)
    address: str = ""
    _server: Any = None

    def answer(self, method: str, script: Script) -> None:
        """Answer every later ``method`` call with ``script``."""
        assert method in METHODS, method
        self.scripts[method] = script

    def reset(self) -> None:
        """Back to honest answers; forget the requests."""
        self.scripts.clear()
        self.requests.clear()

    def received(self, method: str) -> list[Received]:
        return [r for r in self.requests if r.method == method]

    async def start(self) -> str:
        self._server = grpc.aio.server()
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for method, (service, request_type, _) in METHODS.items():
            by_service.setdefault(service, {})[method] = grpc.unary_unary_rpc_method_handler(
                self._handler(method),
                request_deserializer=request_type.FromString,
                # The handler serializes itself, so it can also send bytes of any shape.
                response_serializer=lambda data: data,
            )
        for service, handlers in by_service.items():
            self._server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service, handlers),)
            )
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)

    def _handler(self, method: str) -> Callable[[Any, Any], Any]:
        response_type = METHODS[method][2]

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> bytes:
            metadata = {
                key: value
                for key, value in (context.invocation_metadata() or ())
                if isinstance(value, str)
            }
            self.requests.append(Received(method, request, metadata))
            script = self.scripts.get(method)
            if script is None:
                answer: Answer = demo_project() if method == "GetProject" else response_type()
            elif callable(script):
                answer = script(request)
            else:
                answer = script
            if isinstance(answer, Refuse):
                trailing = ()
                if answer.details is not None:
                    trailing = (("grpc-status-details-bin", answer.details),)
                await context.abort(answer.code, answer.message, trailing_metadata=trailing)
            if isinstance(answer, Park):
                await asyncio.Event().wait()
            if isinstance(answer, Raw):
                return answer.data
            assert isinstance(answer, Message)
            return answer.SerializeToString()

        return handle
