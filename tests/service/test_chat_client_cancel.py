"""``/cancel`` typed while a message is being accepted cancels its turn as soon as the
turn starts: the client knows no turn id yet, so it queues
the cancel and sends it on ``message_accepted``/``turn_started``."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ballet.planner.v1 import chat_pb2, resources_pb2

from ballet_chat.client import ChatClient, ChatOptions
from ballet_common.grpc.channels import make_channel
from devstack.dev import DevApp, DevOptions, start_dev

SLOW = {"rules": [{"reply": {"text": "word " * 200, "chunk_chars": 5, "delay_ms": 50}}]}


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[DevApp]:
    scenario = tmp_path / "slow.json"
    scenario.write_text(json.dumps(SLOW))
    started = await start_dev(
        DevOptions(
            data_dir=tmp_path / "data",
            scenario=scenario,
            address="127.0.0.1:0",
            devstack_address="127.0.0.1:0",
        ),
        {"BALLET_PLANNER__SERVER__METRICS_ADDRESS": "", "BALLET_PLANNER__SERVER__GRACE_S": "7"},
    )
    yield started
    await started.stop()


async def test_a_cancel_before_the_turn_starts_cancels_it_when_it_starts(app: DevApp) -> None:
    options = ChatOptions(address=app.planner.address, token=app.stack.token("alice"))
    client = ChatClient(options, io.StringIO(), io.StringIO())
    client.channel = make_channel(options.address, tls=None, insecure=False)
    try:
        await client.open(title="cancel early")
        await client.send("a long answer, please")
        assert not client.running_turn  # nothing read yet: the turn is not known
        assert await client.request_cancel() == "later"
        while client.busy:
            event = await client.next_event()
            assert isinstance(event, chat_pb2.ChatResponse), event
        (ended,) = client.ended.values()
        assert ended.reason == resources_pb2.TURN_END_REASON_CANCELLED
        assert not client.cancel_requested
        assert await client.request_cancel() == ""  # nothing runs any more
    finally:
        await client.close()
