"""The conversation kept between model calls (service.core.conversation) and the
messages' encodings kept by the gateway client (service.adapters.gateway): both give
exactly what converting everything again gives, and reuse only what cannot have
changed."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from ballet.llm.v1 import gateway_pb2

from bench import conversation as conversation_bench
from service.adapters.gateway_wire import MessageEncodings, to_proto, to_wire
from service.core.context import to_model_messages
from service.core.conversation import MESSAGE_OVERHEAD, Conversations
from service.core.model import Message, MessageKind
from service.core.ports import ModelDeadlines, ModelRequest, Purpose, ToolDeclaration

NOW = datetime(2026, 12, 1, tzinfo=UTC)


class Transcript:
    """A session's messages, numbered as the store numbers them."""

    def __init__(self, session_id: str = "s-1") -> None:
        self.session_id = session_id
        self.messages: list[Message] = []
        self.sequence = 0

    def add(self, turn: int, kind: MessageKind, **fields: object) -> None:
        self.sequence += 1
        self.messages.append(
            Message(
                self.session_id,
                f"t-{turn}",
                f"m-{self.sequence}",
                kind,
                NOW,
                sequence=self.sequence,
                **fields,  # type: ignore[arg-type]
            )
        )

    def turn(self, turn: int, *, ended: bool = True) -> None:
        # Providers reuse their ids ("call_0") across answers: the planner's ids differ.
        self.add(turn, MessageKind.HUMAN, text=f"question {turn}")
        self.add(turn, MessageKind.ASSISTANT, text="Let me look.")
        call = f"pc-{turn}"
        self.add(
            turn,
            MessageKind.TOOL_CALL,
            tool_call_id=call,
            provider_call_id="call_0",
            tool_name="get_item",
            tool_arguments='{"item_id":"PAN-9"}',
        )
        if ended:
            self.finish(turn)

    def finish(self, turn: int) -> None:
        self.add(
            turn,
            MessageKind.TOOL_RESULT,
            tool_call_id=f"pc-{turn}",
            tool_name="get_item",
            tool_result=f'{{"turn":{turn}}}',
        )
        self.add(turn, MessageKind.ASSISTANT, text=f"answer {turn}")


def test_each_call_gives_what_converting_everything_gives() -> None:
    transcript = Transcript()
    conversations = Conversations()
    for turn in range(1, 6):
        # The turn's first round (its call has no result yet), then its second.
        transcript.turn(turn, ended=False)
        running = conversations.model_messages(transcript.session_id, transcript.messages)
        assert running == to_model_messages(transcript.messages)
        transcript.finish(turn)
        running = conversations.model_messages(transcript.session_id, transcript.messages)
        assert running == to_model_messages(transcript.messages)


def test_the_earlier_turns_are_converted_once_and_the_same_objects_returned() -> None:
    transcript = Transcript()
    for turn in range(1, 4):
        transcript.turn(turn)
    transcript.turn(4, ended=False)
    conversations = Conversations()
    first = conversations.model_messages(transcript.session_id, transcript.messages)
    second = conversations.model_messages(transcript.session_id, transcript.messages)
    assert first == second
    earlier = len(to_model_messages(transcript.messages[:-3]))
    assert all(a is b for a, b in zip(first[:earlier], second[:earlier], strict=True))


def test_a_compaction_or_another_replicas_turn_is_never_served_stale() -> None:
    transcript = Transcript()
    for turn in range(1, 5):
        transcript.turn(turn)
    transcript.turn(5, ended=False)
    conversations = Conversations()
    conversations.model_messages(transcript.session_id, transcript.messages)
    # A compaction: the context now starts after the summary's up_to.
    compacted = transcript.messages[10:]
    assert conversations.model_messages(transcript.session_id, compacted) == (
        to_model_messages(compacted)
    )
    # Another replica ran a turn in between: the earlier messages grew.
    longer = Transcript()
    for turn in range(1, 6):
        longer.turn(turn)
    longer.turn(6, ended=False)
    assert conversations.model_messages(longer.session_id, longer.messages) == (
        to_model_messages(longer.messages)
    )


def test_unstored_messages_are_not_kept() -> None:
    transcript = Transcript()
    transcript.turn(1)
    transcript.turn(2, ended=False)
    unstored = [replace(m, sequence=0) for m in transcript.messages]
    conversations = Conversations()
    assert conversations.model_messages("s-1", unstored) == to_model_messages(unstored)
    assert conversations.sessions == 0


def test_sessions_beyond_the_bound_are_dropped_oldest_first() -> None:
    conversations = Conversations(max_sessions=2)
    for name in ("a", "b", "c"):
        transcript = Transcript(name)
        transcript.turn(1)
        transcript.turn(2, ended=False)
        conversations.model_messages(name, transcript.messages)
    assert conversations.sessions == 2


def _request(messages: list[Message]) -> ModelRequest:
    return ModelRequest(
        project_id="p",
        credential_ref="c",
        model="m",
        purpose=Purpose.TURN,
        system_prompt="system",
        messages=to_model_messages(messages),
        tools=(ToolDeclaration("get_item", "Reads an item.", '{"type":"object"}'),),
        request_id="r",
        deadlines=ModelDeadlines(first_delta_s=1, idle_s=1, total_s=1),
    )


def test_kept_encodings_give_the_same_request_as_encoding_everything() -> None:
    transcript = Transcript()
    for turn in range(1, 4):
        transcript.turn(turn)
    request = _request(transcript.messages)
    encodings = MessageEncodings()
    for _ in range(2):  # the second time, some encodings are kept, some evicted
        wire = to_wire(request, encodings)
        assert gateway_pb2.GenerateRequest.FromString(wire) == to_proto(request)
    assert gateway_pb2.GenerateRequest.FromString(to_wire(request)) == to_proto(request)


def test_an_encoding_is_kept_by_identity_never_by_a_reused_id() -> None:
    transcript = Transcript()
    transcript.turn(1)
    encodings = MessageEncodings()
    request = _request(transcript.messages)
    to_wire(request, encodings)
    # Equal-looking but new objects with other text: never the old bytes.
    changed = replace(request, messages=[replace(m, text=m.text + "!") for m in request.messages])
    parsed = gateway_pb2.GenerateRequest.FromString(to_wire(changed, encodings))
    assert parsed == to_proto(changed)


def test_a_turn_that_ended_since_is_converted_alone_and_the_rest_kept() -> None:
    transcript = Transcript()
    for turn in range(1, 4):
        transcript.turn(turn)
    transcript.turn(4, ended=False)
    conversations = Conversations()
    before = conversations.model_messages(transcript.session_id, transcript.messages)
    transcript.finish(4)
    transcript.turn(5, ended=False)
    after = conversations.model_messages(transcript.session_id, transcript.messages)
    assert after == to_model_messages(transcript.messages)
    kept = len(to_model_messages(transcript.messages[:15]))  # turns 1 to 3
    assert all(a is b for a, b in zip(before[:kept], after[:kept], strict=True))


def test_kept_conversations_are_bounded_in_bytes_oldest_session_first() -> None:
    transcripts = []
    for name in ("a", "b", "c"):
        transcript = Transcript(name)
        for turn in range(1, 3):
            transcript.turn(turn)
        transcript.turn(3, ended=False)
        transcripts.append(transcript)
    one = Conversations()
    one.model_messages("a", transcripts[0].messages)  # 10 messages before the running turn
    size = one.bytes
    assert size > 10 * MESSAGE_OVERHEAD
    conversations = Conversations(max_bytes=2 * size)
    for transcript in transcripts:
        conversations.model_messages(transcript.session_id, transcript.messages)
    assert conversations.sessions == 2 and conversations.bytes == 2 * size
    # The oldest went: converting "a" again keeps it and drops "b".
    conversations.model_messages("a", transcripts[0].messages)
    assert conversations.sessions == 2
    assert conversations.model_messages("c", transcripts[2].messages) == to_model_messages(
        transcripts[2].messages
    )


def test_a_conversation_over_the_bound_or_a_bound_of_zero_is_converted_not_kept() -> None:
    transcript = Transcript()
    for turn in range(1, 4):
        transcript.turn(turn)
    transcript.turn(4, ended=False)
    for bound in (0, 1000):
        conversations = Conversations(max_bytes=bound)
        assert conversations.model_messages("s-1", transcript.messages) == (
            to_model_messages(transcript.messages)
        )
        assert conversations.sessions == 0 and conversations.bytes == 0


def test_an_encoding_lives_no_longer_than_its_message() -> None:
    transcript = Transcript()
    transcript.turn(1)
    encodings = MessageEncodings()
    request = _request(transcript.messages)
    to_wire(request, encodings)
    assert len(encodings) == len(request.messages)
    del request
    assert len(encodings) == 0


def test_an_empty_conversations_is_still_one_to_fill() -> None:
    # The turn loop once took ``conversations or a new one``: an empty (so falsy) keeper
    # was replaced on every turn and nothing was ever kept across turns.
    assert Conversations()


def test_the_benchmarks_session_gives_the_same_messages_kept_or_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``python -m bench conversation`` compares the two: they must do the same work.
    messages = conversation_bench.transcript("s-1", 5)
    kept = Conversations()
    for _ in range(2):
        assert kept.model_messages("s-1", messages) == to_model_messages(messages)
    assert kept.sessions == 1
    monkeypatch.setattr(conversation_bench, "CALLS", 5)
    monkeypatch.setattr(conversation_bench, "EARLIER_TURNS", (1, 3))
    assert conversation_bench.main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["earlier_turns"] for row in rows] == [1, 3]
