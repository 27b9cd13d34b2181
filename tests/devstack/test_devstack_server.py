"""The DevStack composition: fault injection, the call record, health, reflection, the
extra-services hook, and ``python -m devstack`` as a user runs it. README.md."""

from __future__ import annotations

import asyncio
import math
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from ballet.knowledge.v1 import knowledge_pb2
from ballet.tracker.v1 import tracker_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ballet_common.tokens import TRACKER_AUDIENCE, dev_secret, mint_dev_token
from devstack.server import DevStack, DevStackConfig
from tests.devstack.fixtures import (
    Clients,
    clients,
    connect,
    demo_stack,
    metadata,
    rpc_error,
    start_stack,
)

__all__ = ["clients", "demo_stack"]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_faults_left(demo_stack: DevStack) -> None:
    demo_stack.faults.clear()


def _get_item() -> tracker_pb2.GetItemRequest:
    return tracker_pb2.GetItemRequest(project_id="demo", item_id="PAN-11")


async def test_a_delay_makes_the_caller_miss_its_deadline(
    demo_stack: DevStack, clients: Clients
) -> None:
    demo_stack.faults.set(method="GetItem", delay_s=30)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await clients.tracker.GetItem(
            _get_item(), metadata=metadata(demo_stack, "alice"), timeout=0.2
        )
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Other RPCs are not delayed.
    await clients.tracker.GetProject(
        tracker_pb2.GetProjectRequest(project_id="demo"),
        metadata=metadata(demo_stack, "alice"),
        timeout=5,
    )
    # The server cancels the delayed handler when the deadline passes and records it.
    await demo_stack.call_log.wait_for(
        lambda log: any(
            record.code == grpc.StatusCode.DEADLINE_EXCEEDED for record in log.for_method("GetItem")
        )
    )


async def test_injected_errors_for_a_number_of_calls(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")
    demo_stack.faults.set(
        method="GetItem", error=grpc.StatusCode.UNAVAILABLE, reason="BACKEND_DOWN", times=2
    )
    for _ in range(2):
        refusal = await rpc_error(clients.tracker.GetItem(_get_item(), metadata=alice))
        assert (refusal.code, refusal.reason) == (grpc.StatusCode.UNAVAILABLE, "BACKEND_DOWN")
        assert refusal.info.domain == "tracker.ballet"
    await clients.tracker.GetItem(_get_item(), metadata=alice)
    codes = [record.code for record in demo_stack.calls_for("GetItem")[-3:]]
    assert codes == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK]


async def test_a_service_rule_applies_to_every_rpc_of_it(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")
    demo_stack.faults.set(service="KnowledgeService", error=grpc.StatusCode.INTERNAL)
    refusal = await rpc_error(
        clients.knowledge.SearchKnowledge(knowledge_pb2.SearchKnowledgeRequest(), metadata=alice)
    )
    assert refusal.code == grpc.StatusCode.INTERNAL
    await clients.tracker.GetItem(_get_item(), metadata=alice)  # another service: unaffected
    demo_stack.faults.clear(service="KnowledgeService")
    await clients.knowledge.SearchKnowledge(knowledge_pb2.SearchKnowledgeRequest(), metadata=alice)


async def test_clear_releases_held_calls(demo_stack: DevStack, clients: Clients) -> None:
    demo_stack.faults.set(method="ListItems", delay_s=math.inf)
    started = demo_stack.call_log.started("ListItems")
    call = asyncio.ensure_future(
        clients.tracker.ListItems(
            tracker_pb2.ListItemsRequest(project_id="demo"),
            metadata=metadata(demo_stack, "alice"),
            timeout=30,
        )
    )
    await demo_stack.call_log.wait_for(lambda log: log.started("ListItems") > started)
    assert not call.done()
    demo_stack.faults.clear()
    response = await call
    assert response.total_size == 21


async def test_calls_record_human_actor_and_request_id(
    demo_stack: DevStack, clients: Clients
) -> None:
    await clients.tracker.GetItem(
        _get_item(),
        metadata=metadata(demo_stack, "bob", actor="planner:s-7", planner=TRACKER_AUDIENCE),
    )
    record = demo_stack.calls_for("GetItem")[-1]
    assert record.service == "ballet.tracker.v1.TrackerService"
    assert (record.human, record.actor, record.project_id) == ("bob", "planner:s-7", "demo")
    assert record.code == grpc.StatusCode.OK and record.request_id == ""
    assert record.duration_s >= 0 and record.start_time > 0
    assert demo_stack.calls[-1] == record


async def test_health_and_reflection(demo_stack: DevStack, clients: Clients) -> None:
    health = health_pb2_grpc.HealthStub(clients.channel)
    for service in ("", "ballet.tracker.v1.TrackerService", "ballet.knowledge.v1.KnowledgeService"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert await _reflected_services(clients.channel) >= {
        "ballet.tracker.v1.TrackerService",
        "ballet.skills.v1.SkillsService",
        "ballet.knowledge.v1.KnowledgeService",
        "grpc.health.v1.Health",
    }


async def _reflected_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for answer in stub.ServerReflectionInfo(requests()):
        return {service.name for service in answer.list_services_response.service}
    return set()


async def test_extra_services_join_the_server(tmp_path: Path) -> None:
    def hello(request: bytes, context: object) -> bytes:
        return b"hello " + request

    def add(server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(hello)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.v1.Echo", {"Say": handler}),)
        )

    stack = await start_stack(tmp_path, extra_services=add)
    try:
        channel = connect(stack.address).channel
        answer = await channel.unary_unary("/test.v1.Echo/Say")(b"devstack")
        assert answer == b"hello devstack"
        assert "test.v1.Echo" in await _reflected_services(channel)
        health = health_pb2_grpc.HealthStub(channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service="test.v1.Echo"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        await channel.close()
    finally:
        await stack.stop()


async def test_only_loopback_addresses_unless_allowed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="loopback"):
        await DevStack.start(DevStackConfig(data_dir=tmp_path, address="0.0.0.0:0"))
    for address in ("localhost:0", "[::1]:0"):
        try:
            stack = await DevStack.start(DevStackConfig(data_dir=tmp_path, address=address))
        except OSError:
            continue  # no IPv6 loopback on this machine
        await stack.stop()


async def test_restarting_on_the_same_data_dir_keeps_data_and_tokens(tmp_path: Path) -> None:
    first = await start_stack(tmp_path)
    clients = connect(first.address)
    alice = metadata(first, "alice")
    try:
        page = await clients.tracker.ListItems(
            tracker_pb2.ListItemsRequest(project_id="demo", page_size=5), metadata=alice
        )
        entry = await clients.knowledge.CreateKnowledgeEntry(
            knowledge_pb2.CreateKnowledgeEntryRequest(
                request_id="restart-1", kind=knowledge_pb2.KNOWLEDGE_KIND_NOTE, title="Kept"
            ),
            metadata=alice,
        )
    finally:
        await clients.channel.close()
        await first.stop()
    second = await start_stack(tmp_path)
    clients = connect(second.address)
    try:
        assert second.dev_secret == first.dev_secret
        rest = await clients.tracker.ListItems(
            tracker_pb2.ListItemsRequest(project_id="demo", page_token=page.next_page_token),
            metadata=alice,
        )
        assert rest.total_size == 21 and len(rest.items) == 16
        kept = await clients.knowledge.GetKnowledgeEntry(
            knowledge_pb2.GetKnowledgeEntryRequest(entry_id=entry.entry.entry_id), metadata=alice
        )
        assert kept.entry.title == "Kept"
        demo = await clients.knowledge.SearchKnowledge(
            knowledge_pb2.SearchKnowledgeRequest(kind=knowledge_pb2.KNOWLEDGE_KIND_DECISION),
            metadata=alice,
        )
        assert [hit.entry.entry_id for hit in demo.hits] == ["ke-decimal-quantities"]
    finally:
        await clients.channel.close()
        await second.stop()


async def test_python_m_devstack_serves_until_interrupted(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devstack",
        "--data-dir",
        str(tmp_path),
        "--address",
        "127.0.0.1:0",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert line.startswith("devstack listening on "), line
        address = line.split()[-1]
        clients = connect(address)
        token = mint_dev_token(dev_secret(tmp_path, create=False), "alice")
        project = await clients.tracker.GetProject(
            tracker_pb2.GetProjectRequest(project_id="demo"),
            metadata=(("authorization", f"Bearer {token}"),),
        )
        assert project.project.settings["planner.skill"] == "demo-planning"
        await clients.channel.close()
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
