"""Tools that did not reach the model are reported (decision 0297): an answer whose
reported input tokens are far below what the tool declarations alone take is counted,
and logged once per model."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest

from service.core.model import TurnEndReason
from service.core.ports import ModelRequest
from service.core.turn import NullObserver
from tests.unit.test_turn_steps import make


@dataclass
class Counted(NullObserver):
    seen: int = 0

    def tools_not_seen(self) -> None:
        self.seen += 1


async def test_an_answer_below_the_tools_size_is_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What llama.cpp reported with a chat template that cannot render tools: the human's
    # words and the instructions, none of the declarations.
    observer = Counted()
    rig = make(lambda r: {"text": "hi", "usage": (300, 5)}, observer=observer)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            turn_id = await rig.run("hello")
            assert rig.end(turn_id).ending.reason is TurnEndReason.COMPLETED
    assert observer.seen == 3
    warnings = [r for r in caplog.records if "dropped the tools" in r.getMessage()]
    assert len(warnings) == 1
    assert "--jinja" in warnings[0].getMessage()


async def test_an_answer_that_saw_the_tools_is_not_counted() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        return {"text": "hi", "usage": (4_000, 5)}

    observer = Counted()
    rig = make(script, observer=observer)
    await rig.run("hello")
    assert observer.seen == 0
