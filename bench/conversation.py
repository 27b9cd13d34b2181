"""``python -m bench conversation``: what one model call spends turning a session's
messages into the gateway request's messages, with the conversation kept between
calls (``service.core.conversation.Conversations``, decisions 0115 and 0392) and with
nothing kept (the bare baseline: the same class bounded to 0 bytes, so every call
converts and encodes every message), in the same run.

A session of N ended one-round turns (the human's question, the answer with one
``get_item`` call, its result, the final answer: four messages of the model's, five
stored) and a running turn in its first round; each model call converts the messages
(``Conversations.model_messages``) and encodes them (``gateway_wire.to_wire`` with the
gateway client's ``MessageEncodings``). Prints microseconds of CPU per model call for
each N and the ratio kept / baseline; ``--json`` prints them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from service.adapters.gateway_wire import MessageEncodings, to_wire
from service.core.conversation import Conversations
from service.core.model import Message, MessageKind
from service.core.ports import ModelDeadlines, ModelRequest, Purpose, ToolDeclaration

NOW = datetime(2026, 12, 7, tzinfo=UTC)
EARLIER_TURNS = (1, 5, 10, 50)
CALLS = 2000


@dataclass(frozen=True)
class Row:
    earlier_turns: int
    messages: int
    baseline_us: float
    kept_us: float

    @property
    def ratio(self) -> float:
        return self.kept_us / self.baseline_us


def transcript(session_id: str, earlier_turns: int) -> list[Message]:
    """``earlier_turns`` ended one-round turns, then a running turn's first round."""
    messages: list[Message] = []

    def add(turn: int, kind: MessageKind, **fields: str) -> None:
        sequence = len(messages) + 1
        messages.append(
            Message(
                session_id,
                f"t-{turn}",
                f"m-{sequence}",
                kind,
                NOW,
                sequence=sequence,
                **fields,  # type: ignore[arg-type]
            )
        )

    for turn in range(1, earlier_turns + 2):
        add(turn, MessageKind.HUMAN, text=f"What is the state of PAN-{turn}?")
        add(turn, MessageKind.ASSISTANT, text="Let me look it up.")
        add(
            turn,
            MessageKind.TOOL_CALL,
            tool_call_id=f"pc-{turn}",
            provider_call_id="call_0",
            tool_name="get_item",
            tool_arguments=f'{{"item_id":"PAN-{turn}"}}',
        )
        if turn <= earlier_turns:
            add(
                turn,
                MessageKind.TOOL_RESULT,
                tool_call_id=f"pc-{turn}",
                tool_name="get_item",
                tool_result='{"item":{"id":"PAN-9","title":"Session lifetime bug","state":"open"}}',
            )
            add(turn, MessageKind.ASSISTANT, text=f"PAN-{turn} is open: the session bug.")
    return messages


def per_call_us(conversations: Conversations, messages: list[Message]) -> float:
    """CPU microseconds of one model call's conversion and encoding, averaged."""
    encodings = MessageEncodings()
    request = ModelRequest(
        project_id="demo",
        credential_ref="demo",
        model="scripted",
        purpose=Purpose.TURN,
        system_prompt="system",
        messages=(),
        tools=(ToolDeclaration("get_item", "Reads an item.", '{"type":"object"}'),),
        request_id="r",
        deadlines=ModelDeadlines(first_delta_s=60, idle_s=60, total_s=300),
    )

    def call() -> None:
        model_messages = conversations.model_messages("s-1", messages)
        to_wire(replace(request, messages=tuple(model_messages)), encodings)

    for _ in range(50):
        call()
    started = time.process_time()
    for _ in range(CALLS):
        call()
    return (time.process_time() - started) / CALLS * 1e6


def measure() -> list[Row]:
    rows = []
    for turns in EARLIER_TURNS:
        messages = transcript("s-1", turns)
        rows.append(
            Row(
                turns,
                len(messages),
                baseline_us=per_call_us(Conversations(max_bytes=0), messages),
                kept_us=per_call_us(Conversations(), messages),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench conversation", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    rows = measure()
    if args.json:
        print(json.dumps([{**row.__dict__, "ratio": row.ratio} for row in rows], indent=2))
        return 0
    print("| earlier turns | stored messages | nothing kept (us/call) | kept (us/call) | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.earlier_turns} | {row.messages} | {row.baseline_us:.0f} "
            f"| {row.kept_us:.0f} | {row.ratio:.2f}x |"
        )
    return 0
