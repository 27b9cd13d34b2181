"""Tracing through the real planner and devstack, in one process (decision 0190).

The planner and the devstack each trace under their own service name into one in-memory
exporter; the rig is the turn tests' (real gRPC on loopback, the scripted gateway). The
end-to-end test (``tests/e2e/test_tracing.py``) does the same across processes through
a real OTLP receiver; here the details: the tree, the links, what attributes carry, the
caller's trace context (and a hostile one), failures whose details quote content, and
the store's background units of work.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ballet_common.tracing import Tracing, make_tracing
from tests.otlp import Behaviour, OtlpReceiver
from tests.service.turn_support import (
    WAIT_S,
    ChatStream,
    Rig,
    events,
    reset,
    start_rig,
    stop_rig,
    wait_for,
)

HUMAN_TEXT = "Zebra quartz lanterns: which epics are open?"
TITLE = "Vermilion harbour planning"
ANSWER = "Two epics are open; the pantry one first."
SECRET_ITEM = "PAN-secret-4711"
#: Text of the demo project that the list_items tool returns to the model.
TOOL_RESULT_TEXT = "Accounts and households"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
async def traced(
    tmp_path_factory: pytest.TempPathFactory, exporter: InMemorySpanExporter
) -> AsyncIterator[tuple[Rig, Tracing]]:
    planner = make_tracing("ballet-planner", [SimpleSpanProcessor(exporter)], service_version="t")
    stack = make_tracing("ballet-devstack", [SimpleSpanProcessor(exporter)], service_version="t")
    rig = await start_rig(tmp_path_factory.mktemp("tracing"), tracing=(planner, stack))
    yield rig, stack
    await stop_rig(rig)
    await stack.shutdown(5)


@pytest.fixture
def rig(traced: tuple[Rig, Tracing], exporter: InMemorySpanExporter) -> Iterator[Rig]:
    reset(traced[0])
    exporter.clear()
    yield traced[0]
    reset(traced[0])


def traceparent() -> tuple[str, str, str]:
    """A W3C traceparent of a sampled caller span: (header, trace id, span id), in hex."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


def service(span: ReadableSpan) -> str:
    return str(span.resource.attributes["service.name"])


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def only_child(spans: Sequence[ReadableSpan], parent: ReadableSpan, name: str) -> ReadableSpan:
    (child,) = [s for s in children(spans, parent) if s.name == name]
    return child


def assert_no_content(spans: Sequence[ReadableSpan], *texts: str) -> None:
    """No span carries any of ``texts``: not in its name, attributes, events, links,
    status or resource (everything ``to_json`` renders)."""
    for span in spans:
        rendered = span.to_json()
        for text in texts:
            assert text not in rendered, (text, span.name)


async def chat_turn(rig: Rig, text: str, *, traceparent_header: str = "") -> list[Any]:
    """Create a session, send ``text`` over Chat with the trace context given, read the
    turn, close the stream; returns what the stream received."""
    session = await rig.create_session(title=TITLE)
    metadata = rig.meta()
    if traceparent_header:
        metadata = (*metadata, ("traceparent", traceparent_header))
    stream = ChatStream(rig.stub.Chat(metadata=metadata))
    await stream.open(session.session_id)
    await stream.opened()
    await stream.send(text, "send-1")
    await stream.turn()
    await stream.done_writing()
    with pytest.raises(EOFError):
        await stream.next()
    return stream.received


def tool_then_answer(tool: str, arguments: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "match": {"last_role": "human"},
            "reply": {"tool_calls": [{"name": tool, "arguments": arguments}]},
        },
        {
            "match": {"last_role": "tool"},
            "reply": {"text": ANSWER, "usage": {"input_tokens": 120, "output_tokens": 12}},
        },
    ]


async def test_one_turn_is_one_tree_across_the_planner_and_the_devstack(
    rig: Rig, exporter: InMemorySpanExporter
) -> None:
    rig.scenario(tool_then_answer("list_items", {"kind": "epic", "state": "open"}))
    header, trace_id, caller_span = traceparent()
    received = await chat_turn(rig, HUMAN_TEXT, traceparent_header=header)
    (ended,) = events(received, "turn_ended")
    spans = [s for s in exporter.get_finished_spans() if hex_trace(s) == trace_id]

    # The Chat RPC's span is the child of the caller's, and everything else descends from
    # it: one tree across both services.
    (rpc,) = named(spans, "ballet.planner.v1.PlannerService/Chat")
    assert rpc.kind is SpanKind.SERVER and rpc.parent is not None
    assert f"{rpc.parent.span_id:016x}" == caller_span
    ids = {s.context.span_id for s in spans if s.context is not None}
    assert all(s.parent is not None and s.parent.span_id in ids for s in spans if s is not rpc)
    assert {service(s) for s in spans} == {"ballet-planner", "ballet-devstack"}

    # The turn: child of the RPC and linked to it (it may outlive it); its ids, no others.
    turn = only_child(spans, rpc, "planner.turn")
    assert [link.context.span_id for link in turn.links] == [rpc.context.span_id]  # type: ignore[union-attr]
    assert turn.attributes is not None
    assert turn.attributes["ballet.planner.turn_id"] == ended.turn_id
    assert turn.attributes["ballet.planner.session_id"] == ended.session_id
    assert turn.attributes["ballet.planner.turn.end_reason"] == "completed"
    assert turn.attributes["ballet.planner.turn.rounds"] == 1

    # One round (the model's call and the tool's) and the answer, each linked to the RPC.
    (round_,) = named(children(spans, turn), "planner.round")
    (answer,) = named(children(spans, turn), "planner.answer")
    for span in (round_, answer):
        assert [link.context.span_id for link in span.links] == [rpc.context.span_id]  # type: ignore[union-attr]
    assert round_.attributes == {"ballet.planner.round": 1, "ballet.planner.tool_calls": 1}

    model = rig.app.settings.planner.model
    for step in (round_, answer):
        call = only_child(spans, step, f"chat {model}")
        assert call.attributes is not None and call.attributes["ballet.planner.purpose"] == "turn"
        client = only_child(spans, call, "ballet.llm.v1.GatewayService/Generate")
        assert client.kind is SpanKind.CLIENT and service(client) == "ballet-planner"
        handled = only_child(spans, client, "ballet.llm.v1.GatewayService/Generate")
        assert handled.kind is SpanKind.SERVER and service(handled) == "ballet-devstack"
    last = only_child(spans, answer, f"chat {model}")
    assert last.attributes is not None
    assert last.attributes["gen_ai.usage.input_tokens"] == 120
    assert last.attributes["gen_ai.response.finish_reasons"] == ("stop",)

    tool = only_child(spans, round_, "execute_tool list_items")
    assert tool.attributes is not None
    assert tool.attributes["gen_ai.tool.name"] == "list_items"
    assert tool.attributes["ballet.planner.outcome"] == "ok"
    client = only_child(spans, tool, "ballet.tracker.v1.TrackerService/ListItems")
    handled = only_child(spans, client, "ballet.tracker.v1.TrackerService/ListItems")
    assert service(handled) == "ballet-devstack"
    assert handled.status.status_code is StatusCode.UNSET

    # Units of work: the turn's start under the RPC, its round's commit under the round, its
    # ending (which also starts a queued turn, decision 0300) under the turn.
    assert named(children(spans, rpc), "store.start_turn")
    assert named(children(spans, round_), "store.commit")
    assert named(children(spans, turn), "store.end_turn")

    token = rig.token()
    assert_no_content(
        exporter.get_finished_spans(),
        HUMAN_TEXT,
        TITLE,
        ANSWER,
        TOOL_RESULT_TEXT,
        '"epic"',
        token,
        token.split(".")[1],
    )


async def test_a_hostile_trace_context_starts_a_trace_of_its_own(
    rig: Rig, exporter: InMemorySpanExporter
) -> None:
    """A malformed traceparent or an oversized tracestate never fails the call; the
    planner starts a new trace (W3C Trace Context: invalid means absent). (Two
    traceparent values cannot arrive: gRPC passes the last one only. The tracestate is
    eight times the 512 characters W3C asks to propagate, and the call's metadata stays
    under gRPC's 8 KiB soft limit, above which the server refuses calls at random.)"""
    _, trace_id, _ = traceparent()
    hostile: list[tuple[tuple[str, str], ...]] = [
        (("traceparent", f"00-{trace_id}-0000000000000000-01"),),  # an all-zero span id
        (("traceparent", f"ff-{trace_id}-00f067aa0ba902b7-01"),),  # a forbidden version
        (("traceparent", "00-xyz-abc-01"),),
        (("traceparent", "00-" + "a" * 32), ("tracestate", "k=" + "v" * 4000)),
    ]
    for extra in hostile:
        exporter.clear()
        response = await rig.stub.ListSessions(
            pb.ListSessionsRequest(project_id=rig.project_id), metadata=(*rig.meta(), *extra)
        )
        assert response is not None
        (span,) = named(
            exporter.get_finished_spans(), "ballet.planner.v1.PlannerService/ListSessions"
        )
        assert span.parent is None, extra
        assert hex_trace(span) != trace_id


async def test_failures_whose_details_quote_content_leave_none_in_the_spans(
    rig: Rig, exporter: InMemorySpanExporter
) -> None:
    """The scripted gateway's "no rule matches" error quotes the human's message, and the
    tracker's NOT_FOUND names the item the model asked for: spans carry the status code
    and reason, never those details. A tool name the model made up is ``unknown``."""
    rig.scenario(tool_then_answer("get_item", {"item_id": SECRET_ITEM}))
    received = await chat_turn(rig, HUMAN_TEXT)
    (ended,) = events(received, "turn_ended")
    (tool,) = named(exporter.get_finished_spans(), "execute_tool get_item")
    assert tool.status.status_code is StatusCode.ERROR
    assert tool.attributes is not None and tool.attributes["ballet.planner.outcome"] == "NOT_FOUND"

    exporter.clear()
    rig.scenario(
        [
            {
                "match": {"last_role": "human"},
                "reply": {"tool_calls": [{"name": "drop_tables_now", "arguments": {}}]},
            }
        ]
    )
    received = await chat_turn(rig, HUMAN_TEXT)
    (ended,) = events(received, "turn_ended")
    assert ended.turn_ended.error_info.reason == "MODEL_ERROR", ended
    spans = exporter.get_finished_spans()
    (turn,) = named(spans, "planner.turn")
    assert turn.status.status_code is StatusCode.ERROR
    assert turn.attributes is not None
    assert turn.attributes["ballet.planner.error_reason"] == "MODEL_ERROR"
    (failed,) = [s for s in named(spans, "planner.answer")]
    assert failed.parent is not None
    (unknown,) = named(spans, "execute_tool unknown")
    assert unknown.attributes is not None and unknown.attributes["gen_ai.tool.name"] == "unknown"
    for name in ("ballet.llm.v1.GatewayService/Generate",):
        errors = [s for s in named(spans, name) if s.status.status_code is StatusCode.ERROR]
        assert errors, name
    assert_no_content(exporter.get_finished_spans(), HUMAN_TEXT, SECRET_ITEM, "drop_tables_now")


async def test_background_units_of_work_send_no_trace_of_their_own(
    rig: Rig, exporter: InMemorySpanExporter
) -> None:
    """Lease renewal, the sweeper and heartbeats run outside any traced operation: they
    make no span, so upkeep does not flood the collector with one-span traces."""
    await wait_for(rig.app.parts.turns.turns.sweep())
    await rig.app.store.ping()
    spans = exporter.get_finished_spans()
    # (A span of an earlier test's stream may end meanwhile; it has its parent.)
    assert [s.name for s in spans if s.parent is None] == []
    assert not [s for s in spans if s.name in ("store.running_turns", "store.ping")]


async def test_tracing_off_traces_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A planner started without tracing answers turns and makes no span: no interceptor
    and no tracer (the global tracer provider, where a stray span would go, stays the
    no-op one)."""
    from opentelemetry import trace

    rig = await start_rig(tmp_path)
    try:
        rig.scenario(tool_then_answer("list_items", {"kind": "epic"}))
        caplog.set_level(logging.WARNING)
        received = await chat_turn(rig, HUMAN_TEXT)
        (ended,) = events(received, "turn_ended")
        assert ended.turn_ended.reason == 1  # COMPLETED
        assert rig.app.parts.tracing is None
        assert not trace.get_current_span().get_span_context().is_valid
        assert type(trace.get_tracer_provider()).__name__ in {
            "ProxyTracerProvider",
            "NoOpTracerProvider",
        }
    finally:
        await stop_rig(rig)


async def test_a_status_the_client_sees_is_unchanged_by_tracing(rig: Rig) -> None:
    """The interceptors only observe: a refused call keeps its code and ErrorInfo."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await rig.stub.GetSession(pb.GetSessionRequest(session_id="nope"), metadata=rig.meta())
    assert refused.value.code() is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("behaviour", ["refuse", "hang"])
async def test_a_collector_in_trouble_holds_up_neither_turns_nor_shutdown(
    tmp_path: Path, behaviour: Behaviour
) -> None:
    """Spans are exported from a thread of their own: while the collector refuses every
    batch (``UNAVAILABLE``, which the exporter retries) or holds one unanswered, a whole
    turn runs to its end and the planner stops within its grace (the spans queued then
    are dropped, decision 0190)."""
    receiver = OtlpReceiver(behaviour)
    endpoint = receiver.start()

    def otlp(service: str) -> Tracing:
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=int(WAIT_S) * 2)
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=10)
        return make_tracing(service, [processor], service_version="t")

    planner, stack = otlp("ballet-planner"), otlp("ballet-devstack")
    rig = await start_rig(tmp_path, tracing=(planner, stack))
    try:
        await rig.create_session(title=TITLE)
        # That call's spans went to the collector, which now refuses or holds them.
        exported = await asyncio.to_thread(receiver.wait_for, lambda r: bool(r.requests), WAIT_S)
        assert exported
        rig.scenario(tool_then_answer("list_items", {"kind": "epic"}))
        received = await chat_turn(rig, HUMAN_TEXT)
        (ended,) = events(received, "turn_ended")
        assert ended.turn_ended.reason == 1  # COMPLETED
        await wait_for(rig.app.stop(1.0))
    finally:
        await stop_rig(rig)
        await stack.shutdown(0)
        receiver.stop()
