"""The terminal client's stream handling against a real planner, in process
(docs/spec/api-and-streams.md and docs/decisions/0051-chat-client.md).

``start_dev`` runs the devstack and the planner on free loopback ports (the composition
``ballet-planner dev`` uses), so the client talks to the real Chat RPC. What a terminal
shows is tested end to end in ``tests/e2e/test_dev_chat.py``; here, what the client does
when its stream breaks, what ``start_dev`` wires, and the demo model's suggestions.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator

import pytest
from ballet.planner.v1 import chat_pb2, resources_pb2
from ballet.planner.v1 import planner_service_pb2 as pb

from ballet_chat.client import ChatClient, ChatOptions
from ballet_chat.input import LineSource
from ballet_chat.run import run_chat
from ballet_common.grpc.channels import make_channel
from devstack.dev import DevApp, DevOptions, start_dev

SCENARIO = {"rules": [{"reply": {"text": "Noted.", "chunk_chars": 2}}]}


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DevApp]:
    folder = tmp_path_factory.mktemp("dev-client")
    scenario = folder / "scenario.json"
    scenario.write_text(json.dumps(SCENARIO))
    started = await start_dev(
        DevOptions(
            data_dir=folder / "data",
            scenario=scenario,
            address="127.0.0.1:0",
            devstack_address="127.0.0.1:0",
        ),
        {"BALLET_PLANNER__SERVER__METRICS_ADDRESS": "", "BALLET_PLANNER__SERVER__GRACE_S": "7"},
    )
    yield started
    await started.stop()


async def client_of(app: DevApp) -> ChatClient:
    options = ChatOptions(address=app.planner.address, token=app.stack.token("alice"))
    client = ChatClient(options, io.StringIO(), io.StringIO())
    client.channel = make_channel(options.address, tls=None, insecure=False)
    return client


async def until_idle(client: ChatClient) -> None:
    while client.busy:
        event = await client.next_event()
        assert isinstance(event, chat_pb2.ChatResponse), event


async def test_a_message_sent_as_the_stream_breaks_is_stored_once(app: DevApp) -> None:
    client = await client_of(app)
    try:
        await client.open(title="reopen")
        assert client.session is not None
        session_id = client.session.session_id
        await client.send("hello")
        # The stream breaks before the answer: the client reopens after the last sequence
        # it saw and sends the message again with the same request id.
        await client.reopen()
        await until_idle(client)
        await client.reopen()  # and once more, with nothing pending: nothing is sent
        listed = await client.stub.ListMessages(
            pb.ListMessagesRequest(session_id=session_id),
            metadata=(("authorization", f"Bearer {client.token}"),),
        )
    finally:
        await client.close()
    humans = [m for m in listed.messages if m.kind == resources_pb2.MESSAGE_KIND_HUMAN]
    assert [m.text for m in humans] == ["hello"]
    (ended,) = client.ended.values()
    assert ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    assert client.renderer.out.getvalue().count("Noted.") == 1  # type: ignore[attr-defined]


async def test_dev_registers_the_gateway_and_points_the_planner_at_the_devstack(
    app: DevApp,
) -> None:
    deps = app.settings.dependencies
    assert {deps.tracker.address, deps.gateway.address} == {app.stack.address}
    assert "ballet.llm.v1.GatewayService" in app.stack.service_names
    before = len(app.gateway.requests)
    client = await client_of(app)
    try:
        await client.open(title="gateway")
        await client.send("anything")
        await until_idle(client)
    finally:
        await client.close()
    assert len(app.gateway.requests) == before + 1
    assert app.gateway.requests[-1].model == app.settings.planner.model


async def test_the_client_knows_its_message_by_request_id_never_by_its_text(app: DevApp) -> None:
    # Another stream of the same human sends the same text first; its message_accepted
    # is still unread when ours is sent. Matched by text, the client would take the
    # other turn for its own (and, for text it had to repair, wait for ever).
    mine, other = await client_of(app), await client_of(app)
    try:
        await mine.open(title="same text")
        assert mine.session is not None
        await other.open(session_id=mine.session.session_id)
        first = await other.send("the same words")
        while not first.done:
            assert isinstance(await other.next_event(), chat_pb2.ChatResponse)
        sent = await mine.send("the same words")  # the other's events wait unread
        while not sent.done:
            assert isinstance(await mine.next_event(), chat_pb2.ChatResponse)
        got = await mine.stub.GetTurn(
            pb.GetTurnRequest(session_id=mine.session.session_id, turn_id=sent.turn_id),
            metadata=(("authorization", f"Bearer {mine.token}"),),
        )
    finally:
        await mine.close()
        await other.close()
    assert first.ok and sent.ok
    assert sent.turn_id != first.turn_id
    assert got.turn.request_id == sent.request_id
    assert list(mine.own_turns) == [sent.turn_id]
    shown = mine.renderer.out.getvalue()  # type: ignore[attr-defined]
    assert shown.count("alice: the same words") == 1  # the other's message, echoed once


async def piped(app: DevApp, lines: str) -> tuple[int, str, str]:
    """``run_chat`` with ``lines`` as its input (not a terminal): its exit code, stdout
    and stderr."""
    out, err = io.StringIO(), io.StringIO()
    options = ChatOptions(address=app.planner.address, token=app.stack.token("alice"))
    code = await run_chat(options, lines=LineSource(io.StringIO(lines)), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("line", "said"),
    [
        # An argument a command does not take is refused, not ignored: "/cancel TURN"
        # or "/new TITLE" would do something else than what was meant.
        ("/new Budget review", "usage: /new (it takes no argument"),
        ("/cancel t-123", "usage: /cancel (it takes no argument"),
        ("/quit now", "usage: /quit (it takes no argument"),
        ("/open", "usage: /open ROW"),
        ("/open 7", "list them with /sessions first"),
        ("/open no-such-session", "error: "),
        ("/interrupt", "usage: /interrupt TEXT"),
        ("/frobnicate", "unknown command /frobnicate"),
    ],
)
async def test_a_piped_command_that_fails_says_why_on_stderr_and_the_chat_exits_1(
    app: DevApp, line: str, said: str
) -> None:
    code, out, err = await piped(app, line + "\n")
    assert code == 1, out + err
    assert f"ballet-planner chat: {said}" in err, err
    assert "> " + line in out  # the transcript shows the line as typed


async def test_piped_commands_that_work_leave_the_exit_code_0(app: DevApp) -> None:
    code, out, err = await piped(app, "/help\n/sessions\n/new\n/history\n/cancel\n")
    assert code == 0, out + err
    assert "ballet-planner chat:" not in err, err


async def test_a_line_starting_with_two_slashes_is_a_message_with_one(app: DevApp) -> None:
    # Decision 0404: "/etc/hosts is what?" could not be sent; "//" drops one slash.
    code, out, err = await piped(app, "//etc/hosts is what?\n/history\n")
    assert code == 0, out + err
    assert "unknown command" not in out + err
    assert "\nalice: /etc/hosts is what?\n" in out, out  # as /history shows it stored
