"""The planner over real gRPC on loopback: session RPCs, identity, health, reflection, metrics.

Every test runs twice, on SQLite and on PostgreSQL (the ``pg_url`` fixture skips without
PostgreSQL on a developer's machine and fails in CI). The tracker is a tiny real gRPC
server (``FakeTracker``).
"""

from __future__ import annotations

import asyncio
import platform
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc, resources_pb2
from google.protobuf import field_mask_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ballet_common.tokens import TRACKER_AUDIENCE, mint_dev_token
from service.adapters.store import migrate
from service.core.sessions import READ_SCOPE
from service.server.root import PlannerApp, start_planner
from service.version import version
from tests.service.planner_support import (
    FakeTracker,
    auth,
    planner_settings,
    reason_of,
    service_token,
    token,
)

PLANNER_SERVICE = "ballet.planner.v1.PlannerService"
RPCS = {
    "CreateSession",
    "GetSession",
    "ListSessions",
    "UpdateSession",
    "DeleteSession",
    "ListMessages",
    "GetTurn",
    "CancelTurn",
    "SendMessage",
    "Chat",
}


@dataclass
class Running:
    app: PlannerApp
    tracker: FakeTracker
    data_dir: Path
    channel: grpc.aio.Channel
    stub: Any
    alice: tuple[tuple[str, str], ...]
    bob: tuple[tuple[str, str], ...]

    def token(self, user: str, **kw: Any) -> str:
        return token(self.data_dir, user, **kw)

    async def create(
        self, who: tuple[tuple[str, str], ...] | None = None, request_id: str = "r1", **kw: Any
    ) -> Any:
        request = pb.CreateSessionRequest(
            request_id=request_id,
            project_id=kw.get("project_id", "demo"),
            title=kw.get("title", ""),
        )
        response = await self.stub.CreateSession(request, metadata=who or self.alice)
        return response.session


@pytest.fixture(params=["sqlite", "postgresql"])
async def planner(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Running]:
    url = ""
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_url")
        await migrate(url)
    tracker = FakeTracker(projects={"demo": ("acme", {"alice", "bob"}), "secret": ("acme", set())})
    await tracker.start()
    settings = planner_settings(tmp_path / "data", tracker.address, url)
    app = await start_planner(settings)
    channel = grpc.aio.insecure_channel(app.address)
    data_dir = tmp_path / "data"
    running = Running(
        app=app,
        tracker=tracker,
        data_dir=data_dir,
        channel=channel,
        stub=planner_service_pb2_grpc.PlannerServiceStub(channel),
        alice=auth(token(data_dir, "alice")),
        bob=auth(token(data_dir, "bob")),
    )
    try:
        yield running
    finally:
        await channel.close()
        await app.stop(0)
        await tracker.stop()


async def expect_error(
    call: Any, code: grpc.StatusCode, reason: str | None = None
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    if reason is not None:
        assert reason_of(caught.value) == reason
    return caught.value


async def test_health_serving_for_overall_and_the_service(planner: Running) -> None:
    health = health_pb2_grpc.HealthStub(planner.channel)
    for service in ("", PLANNER_SERVICE):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_services_and_every_rpc(planner: Running) -> None:
    from google.protobuf import descriptor_pb2

    stub = reflection_pb2_grpc.ServerReflectionStub(planner.channel)

    async def ask(**kw: Any) -> Any:
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(**kw))
        await call.done_writing()
        response = await call.read()
        call.cancel()
        return response

    listed = await ask(list_services="")
    names = {service.name for service in listed.list_services_response.service}
    assert {PLANNER_SERVICE, "grpc.health.v1.Health"} <= names
    found = await ask(file_containing_symbol=PLANNER_SERVICE)
    methods: set[str] = set()
    for raw in found.file_descriptor_response.file_descriptor_proto:
        descriptor = descriptor_pb2.FileDescriptorProto.FromString(raw)
        for service in descriptor.service:
            if service.name == "PlannerService":
                methods |= {method.name for method in service.method}
    assert methods == RPCS


@pytest.mark.parametrize(
    ("make_token", "reason"),
    [
        (lambda r: None, "TOKEN_MISSING"),
        (lambda r: r.token("alice", ttl_s=-3600), "TOKEN_EXPIRED"),
        (lambda r: mint_dev_token(b"a-different-secret-of-32-bytes!!!", "alice"), "TOKEN_INVALID"),
        (lambda r: r.token("alice")[:-4] + "AAAA", "TOKEN_INVALID"),
        (lambda r: "garbage", "TOKEN_INVALID"),
        (lambda r: r.token("alice", audiences=(TRACKER_AUDIENCE,)), "WRONG_AUDIENCE"),
    ],
)
async def test_bad_tokens_are_unauthenticated(
    planner: Running, make_token: Any, reason: str
) -> None:
    value = make_token(planner)
    metadata = auth(value) if value else ()
    session = await planner.create()
    calls = [
        planner.stub.CreateSession(
            pb.CreateSessionRequest(request_id="x", project_id="demo"), metadata=metadata
        ),
        planner.stub.GetSession(
            pb.GetSessionRequest(session_id=session.session_id), metadata=metadata
        ),
        planner.stub.ListSessions(pb.ListSessionsRequest(project_id="demo"), metadata=metadata),
        planner.stub.ListMessages(
            pb.ListMessagesRequest(session_id=session.session_id), metadata=metadata
        ),
        planner.stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=session.session_id), metadata=metadata
        ),
        planner.stub.SendMessage(
            pb.SendMessageRequest(request_id="m", session_id=session.session_id, text="hi"),
            metadata=metadata,
        ),
    ]
    for call in calls:
        await expect_error(call, grpc.StatusCode.UNAUTHENTICATED, reason)
    still = await planner.stub.GetSession(
        pb.GetSessionRequest(session_id=session.session_id), metadata=planner.alice
    )
    assert still.session.session_id == session.session_id


async def test_create_session_asks_the_tracker_as_the_human(planner: Running) -> None:
    session = await planner.create(title="Roadmap")
    assert (session.project_id, session.organization_id, session.owner_id, session.title) == (
        "demo",
        "acme",
        "alice",
        "Roadmap",
    )
    call = planner.tracker.calls[-1]
    assert call.project_id == "demo"
    assert call.metadata["authorization"] == planner.alice[0][1]
    assert call.metadata["x-ballet-actor"].startswith("planner:")
    assert call.metadata["x-ballet-service-authorization"].startswith("Bearer ")
    again = await planner.create(title="Roadmap")
    assert again.session_id == session.session_id
    await expect_error(
        planner.create(title="Other"), grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED"
    )
    await expect_error(
        planner.create(request_id="s", project_id="secret"),
        grpc.StatusCode.NOT_FOUND,
        "PROJECT_NOT_FOUND",
    )
    await expect_error(
        planner.create(request_id="u", project_id="unknown"),
        grpc.StatusCode.NOT_FOUND,
        "PROJECT_NOT_FOUND",
    )
    await expect_error(
        planner.create(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REQUIRED"
    )
    await expect_error(
        planner.create(request_id="x" * 65), grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_TOO_LONG"
    )


async def test_another_humans_session_is_not_found(planner: Running) -> None:
    session = await planner.create()
    sid = session.session_id
    stub, bob = planner.stub, planner.bob
    for call in (
        stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=bob),
        stub.ListMessages(pb.ListMessagesRequest(session_id=sid), metadata=bob),
        stub.UpdateSession(
            pb.UpdateSessionRequest(
                session=resources_pb2.Session(session_id=sid, title="mine"),
                update_mask=field_mask_pb2.FieldMask(paths=["title"]),
            ),
            metadata=bob,
        ),
        stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid), metadata=bob),
        stub.GetTurn(pb.GetTurnRequest(session_id=sid, turn_id="t"), metadata=bob),
        stub.GetSession(pb.GetSessionRequest(session_id="no-such-session"), metadata=bob),
    ):
        await expect_error(call, grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
    listed = await stub.ListSessions(pb.ListSessionsRequest(project_id="demo"), metadata=bob)
    assert list(listed.sessions) == []
    mine = await stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=planner.alice)
    assert mine.session.title == ""


async def test_update_get_list_messages_and_delete(planner: Running) -> None:
    session = await planner.create()
    sid = session.session_id
    updated = await planner.stub.UpdateSession(
        pb.UpdateSessionRequest(
            session=resources_pb2.Session(session_id=sid, title="Q3 plan"),
            update_mask=field_mask_pb2.FieldMask(paths=["title"]),
        ),
        metadata=planner.alice,
    )
    assert updated.session.title == "Q3 plan"
    await expect_error(
        planner.stub.UpdateSession(
            pb.UpdateSessionRequest(
                session=resources_pb2.Session(session_id=sid, project_id="other"),
                update_mask=field_mask_pb2.FieldMask(paths=["project_id"]),
            ),
            metadata=planner.alice,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_UPDATE_MASK",
    )
    messages = await planner.stub.ListMessages(
        pb.ListMessagesRequest(session_id=sid), metadata=planner.alice
    )
    assert (list(messages.messages), messages.next_page_token) == ([], "")
    await expect_error(
        planner.stub.GetTurn(
            pb.GetTurnRequest(session_id=sid, turn_id="nope"), metadata=planner.alice
        ),
        grpc.StatusCode.NOT_FOUND,
        "TURN_NOT_FOUND",
    )
    await planner.stub.DeleteSession(
        pb.DeleteSessionRequest(session_id=sid), metadata=planner.alice
    )
    await expect_error(
        planner.stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=planner.alice),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )


async def test_a_service_principal_reads_its_organization_only(planner: Running) -> None:
    session = await planner.create()
    reader = auth(service_token(planner.data_dir, "service:reports", (READ_SCOPE,)))
    foreign = auth(service_token(planner.data_dir, "service:reports", (READ_SCOPE,), "globex"))
    got = await planner.stub.GetSession(
        pb.GetSessionRequest(session_id=session.session_id), metadata=reader
    )
    assert got.session.owner_id == "alice"
    listed = await planner.stub.ListSessions(
        pb.ListSessionsRequest(project_id="demo"), metadata=reader
    )
    assert [s.session_id for s in listed.sessions] == [session.session_id]
    await expect_error(
        planner.stub.GetSession(
            pb.GetSessionRequest(session_id=session.session_id), metadata=foreign
        ),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )
    await expect_error(
        planner.stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=session.session_id), metadata=reader
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "HUMAN_REQUIRED",
    )
    await expect_error(planner.create(reader), grpc.StatusCode.PERMISSION_DENIED, "HUMAN_REQUIRED")


async def test_walking_250_sessions_by_100_gives_each_exactly_once(planner: Running) -> None:
    created = set()
    for n in range(250):
        created.add((await planner.create(request_id=f"walk-{n}")).session_id)
    seen: list[str] = []
    order: list[tuple[int, str]] = []
    page_token = ""
    pages = 0
    while True:
        page = await planner.stub.ListSessions(
            pb.ListSessionsRequest(project_id="demo", page_size=100, page_token=page_token),
            metadata=planner.alice,
        )
        pages += 1
        seen.extend(s.session_id for s in page.sessions)
        order.extend((s.create_time.ToNanoseconds(), s.session_id) for s in page.sessions)
        page_token = page.next_page_token
        if not page_token:
            break
    assert pages == 3
    assert len(seen) == 250 and set(seen) == created
    assert order == sorted(order, reverse=True)  # newest first, ties by id


async def test_page_size_and_page_token_errors(planner: Running) -> None:
    for n in range(3):
        await planner.create(request_id=f"p{n}")
    for call in (
        planner.stub.ListSessions(
            pb.ListSessionsRequest(project_id="demo", page_size=-1), metadata=planner.alice
        ),
        planner.stub.ListMessages(
            pb.ListMessagesRequest(session_id="x", page_size=-1), metadata=planner.alice
        ),
    ):
        error = await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_SIZE")
        assert "page_size" in (error.details() or "")
    first = await planner.stub.ListSessions(
        pb.ListSessionsRequest(project_id="demo", page_size=1), metadata=planner.alice
    )
    good = first.next_page_token
    assert good
    tampered = good[:-2] + ("AA" if not good.endswith("AA") else "BB")
    for bad, who in (
        (tampered, planner.alice),
        ("bm90IGEgdG9rZW4", planner.alice),
        (good, planner.bob),
    ):
        await expect_error(
            planner.stub.ListSessions(
                pb.ListSessionsRequest(project_id="demo", page_size=1, page_token=bad), metadata=who
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PAGE_TOKEN",
        )
    await expect_error(
        planner.stub.ListSessions(pb.ListSessionsRequest(project_id=""), metadata=planner.alice),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PROJECT_ID_REQUIRED",
    )


async def test_metrics_endpoint(planner: Running) -> None:
    await planner.create()
    await expect_error(
        planner.stub.GetSession(pb.GetSessionRequest(session_id="x")),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    url = f"http://{planner.app.metrics_address}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert "ballet_planner_dev_mode 1.0" in body
    assert (
        'ballet_planner_grpc_server_handled_total{grpc_code="OK",'
        'grpc_method="/ballet.planner.v1.PlannerService/CreateSession"} 1.0'
    ) in body
    assert (
        'ballet_planner_grpc_server_handled_total{grpc_code="UNAUTHENTICATED",'
        'grpc_method="/ballet.planner.v1.PlannerService/GetSession"} 1.0'
    ) in body
    for name in (
        "ballet_planner_compactions_total",
        "ballet_planner_turns_total",
        "ballet_planner_open_streams",
        "ballet_planner_running_turns",
        "ballet_planner_grpc_server_handling_seconds",
    ):
        assert name in body
    assert "alice" not in body and "demo" not in body


async def test_metrics_endpoint_has_build_process_and_runtime_metrics(planner: Running) -> None:
    # Process and runtime metrics, and a build-info metric with the version.
    url = f"http://{planner.app.metrics_address}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    python = platform.python_version()
    build = f'ballet_planner_build_info{{python="{python}",version="{version()}"}} 1.0'
    assert build in body
    assert version() != "0+unknown"
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
        "python_info",
        "python_gc_collections_total",
    ):
        assert f"\n{name}" in body, name
