"""Store, then tell has one owner (decision 0330): one publish after a commit, one
turn-ended count, and a turn's duration measured the same whichever way it ends."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.core.model import TurnEndReason, TurnState
from service.core.ports import ModelRequest
from service.core.turn import NullObserver
from tests.unit.test_turn import make_rig

SERVICE = Path(__file__).resolve().parents[2] / "service"


def calls_of(attribute: str, receiver: str = "") -> list[str]:
    """Every call ``<x>.attribute(...)`` under service/ whose receiver's source holds
    ``receiver``, as ``path:line``."""
    found = []
    for path in sorted(SERVICE.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == attribute
                and receiver in (ast.get_source_segment(source, node.func.value) or "")
            ):
                found.append(f"{path.relative_to(SERVICE).as_posix()}:{node.lineno}")
    return found


def test_one_publish_after_a_commit_and_one_turn_ended_count() -> None:
    # The hub publishes what it read from the store itself (a stream's fill); every
    # other publish follows a commit and goes through StoreThenTell.
    publishes = [c for c in calls_of("publish") if not c.startswith("core/fanout.py:")]
    assert [c.split(":")[0] for c in publishes] == ["core/turn/telling.py"]
    counted = calls_of("turn_ended", "observer")
    assert [c.split(":")[0] for c in counted] == ["core/turn/telling.py"]


class Durations(NullObserver):
    """Keeps every ``turn_ended`` count as (reason, ErrorInfo reason, rounds, seconds)."""

    def __init__(self) -> None:
        self.ended: list[tuple[Any, ...]] = []

    def turn_ended(self, *counted: Any) -> None:
        self.ended.append(counted)


async def test_the_duration_is_counted_the_same_by_the_loop_and_the_sweeper() -> None:
    observer = Durations()
    holder: dict[str, Any] = {}

    def script(request: ModelRequest) -> dict[str, Any]:
        holder["rig"].clock.advance(7)
        return {"text": "done", "usage": (10, 2)}

    rig = holder["rig"] = make_rig(script, observer=observer)
    turn_id = await rig.run("hello")
    assert observer.ended == [(TurnEndReason.COMPLETED, "", 0, 7.0)]

    # Another replica's turn, started 30 s ago, whose lease expired: the sweeper ends it.
    turn = rig.store.turns[turn_id]
    rig.store.turns["turn_dead"] = replace(
        turn,
        turn_id="turn_dead",
        state=TurnState.RUNNING,
        end_reason=None,
        owner="r-dead",
        request_id="dead",
        rounds=2,
        start_time=rig.clock.now(),
        lease_expires_at=rig.clock.now(),
    )
    rig.clock.advance(30)
    assert await rig.service.sweep() == 1
    assert observer.ended[1] == (TurnEndReason.INTERRUPTED, "INTERRUPTED", 2, 30.0)
