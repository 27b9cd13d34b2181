"""With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, one Chat turn with a
tool call yields one trace whose spans cover the RPC, the turn, each round, each model
call, each tool call and the devstack's handling of both, with no message text in any
attribute.

``python -m devstack`` and ``ballet-planner serve`` run as separate processes, each
exporting OTLP over gRPC to a real receiver on loopback (``tests/otlp.py``) with the
standard variables alone. The client sends a W3C ``traceparent``, so the trace is the
caller's; both processes are stopped as an operator would (SIGTERM, Ctrl-C), which
exports the spans still queued.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from ballet_common.tokens import HUMAN_AUDIENCES, dev_secret, mint_dev_token
from tests.e2e.dev_support import DevProcess, clean_env, command
from tests.e2e.test_cli_serve import serve_address, wait_serving
from tests.e2e.test_devstack_standalone import printed_command, read_banner
from tests.otlp import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

HUMAN_TEXT = "Zebra quartz lanterns: which epics are open?"
TITLE = "Vermilion harbour planning"
ANSWER = "Two epics are open, lantern keeper."
#: The tool's arguments, and text of the demo project the tool returns to the model.
ARGUMENTS = {"kind": "epic", "state": "open"}
TOOL_RESULT_TEXT = "Pantry inventory"
SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    started = OtlpReceiver()
    started.start()
    yield started
    started.stop()


def stop(process: subprocess.Popen[str], signum: int) -> None:
    process.send_signal(signum)
    try:
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()


def chat_once(address: str, token: str, header: str) -> list[chat_pb2.ChatResponse]:
    """Open a new session over Chat, send the message, read to the turn's end, then
    half-close, so the server ends the stream: the RPC's span ends with it."""
    sent_all = False
    received: list[chat_pb2.ChatResponse] = []

    def requests() -> Iterator[chat_pb2.ChatRequest]:
        nonlocal sent_all
        yield chat_pb2.ChatRequest(
            request_id="open-1",
            open=chat_pb2.OpenAction(project_id="demo", title=TITLE),
        )
        yield chat_pb2.ChatRequest(
            request_id="send-1", send_message=chat_pb2.SendMessageAction(text=HUMAN_TEXT)
        )
        sent_all = True

    with grpc.insecure_channel(address) as channel:
        stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
        metadata = (("authorization", f"Bearer {token}"), ("traceparent", header))
        for response in stub.Chat(requests(), metadata=metadata, timeout=60):
            received.append(response)
    assert sent_all
    return received


def test_one_chat_turn_is_one_trace_across_the_planner_and_the_devstack(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    endpoint = receiver.endpoint
    scenario = {
        "rules": [
            {
                "match": {"purpose": "turn", "last_role": "human", "last_text_regex": "Zebra"},
                "reply": {"tool_calls": [{"name": "list_items", "arguments": ARGUMENTS}]},
            },
            {
                "match": {"purpose": "turn", "last_role": "tool"},
                "reply": {"text": ANSWER, "usage": {"input_tokens": 90, "output_tokens": 9}},
            },
        ]
    }
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    stack = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devstack",
            "--address",
            "127.0.0.1:0",
            "--data-dir",
            "data",
            "--scenario",
            "scenario.json",
        ],
        cwd=tmp_path,
        env=clean_env(**otel),
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "devstack.log").open("w"),
        text=True,
    )
    try:
        banner = read_banner(stack)
        serve_env = dict(
            word.split("=", 1)
            for word in printed_command(banner, "ballet-planner", "serve")
            if "=" in word
        )
        serve_env.update(
            BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
            BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
            **otel,
        )
        with (tmp_path / "serve.log").open("w") as log:
            served = subprocess.Popen(
                [*command(), "serve", "--ready-file", "ready.json"],
                cwd=tmp_path,
                env=clean_env(**serve_env),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                address = serve_address(tmp_path / "ready.json", served, tmp_path / "serve.log")
                wait_serving(address, served, tmp_path)
                token = mint_dev_token(
                    dev_secret(tmp_path / "data"), "alice", audiences=HUMAN_AUDIENCES
                )
                trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
                received = chat_once(address, token, f"00-{trace_id}-{caller}-01")
            finally:
                stop(served, signal.SIGTERM)
    finally:
        stop(stack, signal.SIGINT)
    assert served.returncode == 0, (tmp_path / "serve.log").read_text()
    assert stack.returncode == 0, (tmp_path / "devstack.log").read_text()

    (ended,) = [r for r in received if r.WhichOneof("event") == "turn_ended"]
    assert ended.turn_ended.reason == 1, ended  # COMPLETED
    assert [r for r in received if r.WhichOneof("event") == "tool_call_finished"]

    spans = [s for s in receiver.spans() if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    assert {s.service for s in spans} == {"ballet-planner", "ballet-devstack"}

    def named(name: str, parent: ReceivedSpan | None = None) -> list[ReceivedSpan]:
        return [
            s
            for s in spans
            if s.span.name == name and (parent is None or s.parent_span_id == parent.span_id)
        ]

    # The RPC: the caller's child; every other span descends from it: one tree.
    (rpc,) = named("ballet.planner.v1.PlannerService/Chat")
    assert rpc.span.kind == SERVER and rpc.parent_span_id == caller
    for span in spans:
        if span is not rpc:
            assert span.parent_span_id in by_id, span.span.name

    # The turn, child of the RPC and linked to it; a round and the answer, linked too.
    (turn,) = named("planner.turn", rpc)
    assert [link.span_id.hex() for link in turn.span.links] == [rpc.span_id]
    assert turn.attributes()["ballet.planner.turn_id"] == ended.turn_id
    assert turn.attributes()["ballet.planner.turn.rounds"] == 1
    (round_,) = named("planner.round", turn)
    (answer,) = named("planner.answer", turn)
    for step in (round_, answer):
        assert [link.span_id.hex() for link in step.span.links] == [rpc.span_id]
        # Each model call, the planner's call to the gateway and the devstack's handling.
        (model,) = [
            s for s in spans if s.parent_span_id == step.span_id and s.span.name.startswith("chat ")
        ]
        (call,) = named("ballet.llm.v1.GatewayService/Generate", model)
        assert call.span.kind == CLIENT and call.service == "ballet-planner"
        (handled,) = named("ballet.llm.v1.GatewayService/Generate", call)
        assert handled.span.kind == SERVER and handled.service == "ballet-devstack"
    # The tool call, the planner's call to the tracker and the devstack's handling.
    (tool,) = named("execute_tool list_items", round_)
    (call,) = named("ballet.tracker.v1.TrackerService/ListItems", tool)
    (handled,) = named("ballet.tracker.v1.TrackerService/ListItems", call)
    assert handled.service == "ballet-devstack" and handled.span.kind == SERVER

    # No content anywhere in what was exported: not in any attribute, event, link,
    # status or resource of any span, of this trace or another.
    exported = b"".join(request.SerializeToString() for request in receiver.requests)
    for text in (HUMAN_TEXT, TITLE, ANSWER, TOOL_RESULT_TEXT, json.dumps(ARGUMENTS), token):
        assert text.encode() not in exported, text
    assert b"Zebra" not in exported and b"lantern" not in exported


def test_dev_traces_the_planner_and_the_devstack_each_under_its_name(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    """``ballet-planner dev`` runs both in one process; each exports under its own
    service name, and a turn is one trace across the two (the chat client sends no trace
    context: the Chat RPC's span is the root)."""
    dev = DevProcess.start(
        ["--data-dir", "data"], tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint
    )
    try:
        chat = dev.chat("--message", "What are the open epics?")
        assert chat.returncode == 0, chat.stdout + chat.stderr
    finally:
        code, _ = dev.stop()
    assert code == 0, dev.log()
    spans = receiver.spans()
    (turn,) = [s for s in spans if s.span.name == "planner.turn"]
    trace = [s for s in spans if s.trace_id == turn.trace_id]
    (rpc,) = [s for s in trace if s.span.name == "ballet.planner.v1.PlannerService/Chat"]
    assert rpc.parent_span_id == "" and turn.parent_span_id == rpc.span_id
    handled = {s.span.name for s in trace if s.service == "ballet-devstack"}
    assert {
        "ballet.llm.v1.GatewayService/Generate",
        "ballet.tracker.v1.TrackerService/ListItems",
    } <= handled
    exported = b"".join(request.SerializeToString() for request in receiver.requests)
    assert b"open epics" not in exported
