"""A model answer or tool call holding a NUL character is stored with U+FFFD instead and
the turn completes (PostgreSQL text cannot hold NUL; it used to fail the turn INTERNAL,
with the answer already streamed to the client but never stored). Found while fuzzing
Chat."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import resources_pb2

from tests.hardening.support import Chat, start_stack

pytestmark = pytest.mark.postgres

RULES: list[dict[str, Any]] = [
    {
        "match": {"last_role": "human", "last_text_regex": "tool"},
        "reply": {"tool_calls": [{"name": "get_item", "raw_arguments": '{"item_id": "a\x00b"}'}]},
    },
    {"match": {"last_role": "tool"}, "reply": {"text": "after the tool"}},
    {"reply": {"text": "nul \x00 here", "chunk_chars": 3}},
]


async def test_nul_in_model_output_is_stored_as_a_replacement_character(
    tmp_path: Path, pg_url: str
) -> None:
    stack = await start_stack(tmp_path / "data", RULES, database_url=pg_url)
    try:
        planner = await stack.planner("replica-a")
        chat = Chat(planner.stub, stack.auth())
        await chat.open()
        for request_id, text in (("plain", "say it"), ("tool", "use a tool")):
            ended = await chat.turn(text, request_id)
            assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
        await chat.close()
        listed = await planner.stub.ListMessages(
            pb.ListMessagesRequest(session_id=chat.session_id), metadata=stack.auth()
        )
        kinds = resources_pb2
        answers = [m.text for m in listed.messages if m.kind == kinds.MESSAGE_KIND_ASSISTANT]
        assert answers[0] == "nul \ufffd here"
        calls = [m for m in listed.messages if m.kind == kinds.MESSAGE_KIND_TOOL_CALL]
        assert json.loads(calls[0].tool_arguments) == {"item_id": "a\ufffdb"}
    finally:
        await stack.stop()
