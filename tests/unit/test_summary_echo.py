"""A summary must be a summary (decision 0294): an echo of the compaction request, a copy
of its input, or a text not shorter than what it replaces is refused like a refusal
(logged, counted by cause, nothing stored); a real summary is accepted."""

from __future__ import annotations

from typing import Any

from service.core import prompts
from service.core.compaction import (
    COMPACTION_REQUEST,
    compaction_framing,
    compaction_system_prompt,
)
from service.core.model import EventKind, MessageKind, TurnEndReason
from service.core.ports import FinishReason, ModelRequest, Purpose
from service.core.summaries import NOT_SHORTER_FLOOR_TOKENS, check_summary
from service.server.metrics import Metrics
from service.server.observer import PrometheusTurnObserver
from tests.unit.test_compaction import A_SUMMARY, make

FRAMING = compaction_framing(prompts.summary_instructions())
CONVERSATION = (
    "human: Which pantry epics are still open, and which of their tickets can be run now?\n"
    "planner called list_items with kind epic and got PAN-1 Pantry inventory, PAN-4 "
    "Pantry restock, both open, and PAN-7 Pantry labels, closed last week.\n"
    "planner called list_runnable and got PAN-41 order rice and PAN-42 order beans.\n"
    "assistant: PAN-1 and PAN-4 are open; PAN-41 and PAN-42 can be run now.\n"
) * 4


def check(text: str, *, replaced: int = 2_000, source: str = CONVERSATION) -> str | None:
    rejection = check_summary(
        text, FinishReason.STOP, replaced_tokens=replaced, framing=FRAMING, source=source
    )
    return None if rejection is None else rejection.reason


def test_a_real_summary_is_accepted() -> None:
    assert check(A_SUMMARY) is None


def test_an_echo_of_the_request_is_refused() -> None:
    # What a small model answered on a real server: the request, repeated.
    echoed = compaction_system_prompt(prompts.summary_instructions(), "", CONVERSATION)
    assert check(echoed) == "echo"
    assert check(f"<earlier_summary>\n(none)\n</earlier_summary>\n{A_SUMMARY}") == "echo"
    assert check(f"{A_SUMMARY}\n\n{COMPACTION_REQUEST}") == "echo"
    assert check(f"{A_SUMMARY}\n</conversation>") == "echo"


def test_a_copy_of_the_input_is_refused() -> None:
    copied = CONVERSATION.splitlines()[1] + " " + CONVERSATION.splitlines()[2]
    assert check(copied) == "verbatim"


def test_a_summary_not_shorter_than_what_it_replaces_is_refused() -> None:
    long = " ".join(f"The planner noted fact number {n} about the pantry." for n in range(30))
    assert check(long, replaced=100, source="") == "not_shorter"
    assert check(long, replaced=5_000, source="") is None
    # A few sentences for a short exchange are let through.
    assert check(A_SUMMARY, replaced=10, source="") is None
    assert NOT_SHORTER_FLOOR_TOKENS >= 32


async def test_an_echoed_summary_stores_nothing_and_is_counted_by_cause() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            # The request's own system prompt, sent back as the summary.
            return {"text": request.system_prompt, "usage": (700, 400)}
        return {"text": "answer", "usage": (900, 10)}

    rig = make(script, compact_at_tokens=500)
    await rig.run("first")
    events_before = len(rig.store.events["s1"])
    turn_id = await rig.run("second")
    assert (rig.session.summary, rig.session.summary_up_to) == ("", 0)
    assert rig.observer.failures == ["echo"]
    assert rig.store.turns[turn_id].end_reason is TurnEndReason.COMPLETED
    kinds = [e.kind for e in rig.store.events["s1"][events_before:]]
    assert EventKind.COMPACTED not in kinds
    assert not [m for m in rig.store.messages["s1"] if m.kind is MessageKind.COMPACTION]


def test_refusals_are_counted_by_cause_and_failed_calls_are_not() -> None:
    metrics = Metrics()
    observer = PrometheusTurnObserver(metrics)
    for reason in ("echo", "echo", "verbatim", "model", "budget"):
        observer.compaction_failed(reason)

    def sample(cause: str) -> float | None:
        return metrics.registry.get_sample_value(
            "ballet_planner_compaction_refusals_total", {"cause": cause}
        )

    assert (sample("echo"), sample("verbatim"), sample("model")) == (2.0, 1.0, None)


async def test_a_stored_summary_records_its_prompt_version() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            return {"text": A_SUMMARY, "usage": (700, 30)}
        return {"text": "answer", "usage": (900, 10)}

    rig = make(script, compact_at_tokens=500)
    await rig.run("first")
    await rig.run("second")
    assert rig.session.summary == A_SUMMARY
    (marker,) = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.COMPACTION]
    assert marker.prompt_version == prompts.SUMMARY_VERSION
