"""Fixtures and helpers of the devstack backend tests (tracker, skills, knowledge).

Kept apart from ``conftest.py`` (the gateway tests' file): test modules import what they
use, e.g. ``from tests.devstack.fixtures import demo_stack, clients``.

- ``demo_stack``: a ``DevStack`` with the built-in demo project on SQLite in a temporary
  data dir, on 127.0.0.1 port 0, shared by one test module.
- ``clients``: stubs of the three backends on one channel to it.
- ``metadata``: the metadata a user (and optionally the planner) sends.
- ``rpc_error``: await a call that must fail; returns its code and its one ErrorInfo.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.knowledge.v1 import knowledge_pb2_grpc
from ballet.skills.v1 import skills_pb2_grpc
from ballet.tracker.v1 import tracker_pb2_grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from devstack.server import DevStack, DevStackConfig

Metadata = tuple[tuple[str, str], ...]


@dataclass
class Clients:
    """Stubs of the three backends of one devstack, on one channel."""

    channel: grpc.aio.Channel
    tracker: tracker_pb2_grpc.TrackerServiceStub
    skills: skills_pb2_grpc.SkillsServiceStub
    knowledge: knowledge_pb2_grpc.KnowledgeServiceStub


def connect(address: str) -> Clients:
    """Open a channel to ``address`` and wrap the three stubs (close ``channel`` after)."""
    channel = grpc.aio.insecure_channel(address)
    return Clients(
        channel=channel,
        tracker=tracker_pb2_grpc.TrackerServiceStub(channel),
        skills=skills_pb2_grpc.SkillsServiceStub(channel),
        knowledge=knowledge_pb2_grpc.KnowledgeServiceStub(channel),
    )


def metadata(
    stack: DevStack,
    user: str | None,
    *,
    actor: str | None = None,
    planner: str = "",
    credential: str | None = None,
    **token: Any,
) -> Metadata:
    """What a call as ``user`` carries: their bearer token (none when ``user`` is None),
    ``x-ballet-actor`` when ``actor`` is given, and the planner's service credential for
    the audience ``planner`` (e.g. ``ballet-tracker``) when given, or the explicit
    ``credential``."""
    pairs: list[tuple[str, str]] = []
    if user is not None:
        pairs.append(("authorization", f"Bearer {stack.token(user, **token)}"))
    if actor is not None:
        pairs.append(("x-ballet-actor", actor))
    if planner or credential is not None:
        value = credential if credential is not None else stack.planner_credential(planner)
        pairs.append(("x-ballet-service-authorization", f"Bearer {value}"))
    return tuple(pairs)


@dataclass(frozen=True)
class Refusal:
    """A failed call: its status code, its one ErrorInfo, and its message."""

    code: grpc.StatusCode
    info: error_details_pb2.ErrorInfo
    message: str

    @property
    def reason(self) -> str:
        """The ErrorInfo reason."""
        return str(self.info.reason)


async def rpc_error(call: Awaitable[Any]) -> Refusal:
    """Await ``call``, which must fail with a rich status holding exactly one ErrorInfo."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        status = rpc_status.from_call(error)
        assert status is not None, f"{error.code()} without a google.rpc.Status"
        infos = []
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            assert detail.Unpack(info), f"unexpected detail {detail.type_url}"
            infos.append(info)
        assert len(infos) == 1, infos
        return Refusal(code=error.code(), info=infos[0], message=error.details() or "")
    raise AssertionError("the call succeeded")


async def start_stack(data_dir: Path, **config: Any) -> DevStack:
    """Start a devstack on 127.0.0.1 port 0 with ``data_dir`` and other config fields."""
    return await DevStack.start(DevStackConfig(data_dir=data_dir, address="127.0.0.1:0", **config))


@pytest.fixture(scope="module")
async def demo_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DevStack]:
    """The demo project on SQLite, shared by the tests of one module."""
    stack = await start_stack(tmp_path_factory.mktemp("devstack"))
    try:
        yield stack
    finally:
        await stack.stop()


@pytest.fixture(scope="module")
async def clients(demo_stack: DevStack) -> AsyncIterator[Clients]:
    """Stubs of the demo stack's three backends."""
    connected = connect(demo_stack.address)
    try:
        yield connected
    finally:
        await connected.channel.close()
