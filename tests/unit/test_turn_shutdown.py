"""``TurnService.stop``: the graceful shutdown of a replica's turns (docs/spec/operations.md;
decision 0181), with in-memory fakes.

Turns end on their own while the grace period leaves room; the rest are stopped
``INTERRUPTED``, a started write getting ``cancel_grace``; a run that does not store its
end in time is cancelled and its turn closed from what is stored. When ``stop`` returns,
every turn of the replica has ended in the store.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from service.core.errors import Unavailable
from service.core.fanout import Hub
from service.core.model import MessageKind, Session, TurnEndReason, TurnState
from service.core.ports import ModelRequest, Role, TurnCommit
from service.core.tools import ToolRunner, declarations
from service.core.turn import TurnDependencies, TurnService, TurnSettings
from service.core.turn.service import STOP_MARGIN_S
from tests.unit.fakes import FakeBackends, FakeClock, FakeStore, ScriptedGateway, last_role
from tests.unit.test_turn import Rig

CANCEL_GRACE_S = 0.2


def make_rig(script: Any, *, store: FakeStore | None = None, **settings: Any) -> Rig:
    """``tests.unit.test_turn``'s rig, on ``store`` when given."""
    store = store or FakeStore()
    clock = FakeClock()
    session = store.add_session(
        Session(
            session_id="s1",
            project_id="demo",
            organization_id="acme",
            owner_id="alice",
            title="t",
            create_time=clock.now(),
            update_time=clock.now(),
        )
    )
    gateway = ScriptedGateway(script)
    backends = FakeBackends()
    hub = Hub(store.events_after)
    service = TurnService(
        TurnDependencies(
            store=store,
            gateway=gateway,
            backends=backends,
            hub=hub,
            clock=clock,
            settings=TurnSettings(**{"model": "test-model", "max_rounds": 4, **settings}),
            replica_id="r1",
            tools=ToolRunner(backends),
            declarations=declarations(),
        )
    )
    return Rig(service, store, gateway, backends, hub, clock, session)


def writes(request: ModelRequest) -> dict[str, Any]:
    if last_role(request) is Role.USER:
        return {"tool_calls": [("create_knowledge", '{"kind":"note","title":"t","body":"b"}')]}
    return {"text": "written"}


def stored_results(rig: Rig) -> list[dict[str, Any]]:
    return [
        json.loads(m.tool_result)
        for m in rig.store.messages["s1"]
        if m.kind is MessageKind.TOOL_RESULT
    ]


async def test_a_held_write_gets_its_grace_then_the_turn_ends_interrupted() -> None:
    rig = make_rig(writes, cancel_grace_s=CANCEL_GRACE_S)
    rig.backends.block["create_knowledge"] = asyncio.Event()  # never released
    turn_id = await rig.send("write it down")
    await rig.backends.reached("create_knowledge").wait()
    # The least grace that holds both: the write's grace, and the turn's own end.
    await rig.service.stop(CANCEL_GRACE_S + STOP_MARGIN_S)
    turn = rig.store.turns[turn_id]
    assert (turn.state, turn.end_reason, turn.error_reason) == (
        TurnState.ENDED,
        TurnEndReason.INTERRUPTED,
        "INTERRUPTED",
    )
    (result,) = stored_results(rig)
    assert result["error"]["message"] == "interrupted; the outcome is unknown"
    assert rig.service.running == 0


async def test_a_write_that_returns_within_its_grace_keeps_its_result() -> None:
    rig = make_rig(writes, cancel_grace_s=30.0)
    release = asyncio.Event()
    rig.backends.block["create_knowledge"] = release
    turn_id = await rig.send("write it down")
    await rig.backends.reached("create_knowledge").wait()
    stopping = asyncio.get_running_loop().create_task(rig.service.stop(30.0 + STOP_MARGIN_S))
    # Stopped at once (the period leaves no time to end on its own), the turn waits for
    # its started write...
    for _ in range(5):
        await asyncio.sleep(0)
    assert not stopping.done()
    release.set()
    await stopping
    # ...which lands, so its real result is stored, then the end.
    turn = rig.store.turns[turn_id]
    assert turn.end_reason is TurnEndReason.INTERRUPTED
    (result,) = stored_results(rig)
    assert "error" not in result


async def test_turns_end_on_their_own_while_the_period_leaves_room() -> None:
    release = asyncio.Event()
    rig = make_rig(lambda r: {"chunks": ["Hel", "lo"], "block": release})
    turn_id = await rig.send("go")
    await rig.gateway.started.wait()
    stopping = asyncio.get_running_loop().create_task(rig.service.stop(60.0))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not stopping.done()
    release.set()
    await stopping
    assert rig.store.turns[turn_id].end_reason is TurnEndReason.COMPLETED


class StuckEnding(FakeStore):
    """A store whose first commit that ends a turn never returns (a run stuck there)."""

    stuck = False

    async def commit(self, commit: TurnCommit) -> list[Any]:
        patch = commit.turn_patch
        if not self.stuck and patch is not None and patch.end_reason is not None:
            self.stuck = True
            await asyncio.Event().wait()
        return await super().commit(commit)


async def test_a_run_that_does_not_store_its_end_is_closed_from_the_store() -> None:
    store = StuckEnding()
    rig = make_rig(lambda r: {"chunks": ["Hello"], "block": asyncio.Event()}, store=store)
    turn_id = await rig.send("go")
    await rig.gateway.started.wait()
    await rig.service.stop(CANCEL_GRACE_S + STOP_MARGIN_S)
    turn = store.turns[turn_id]
    assert (turn.state, turn.end_reason) == (TurnState.ENDED, TurnEndReason.INTERRUPTED)
    assert store.stuck and rig.service.running == 0


async def test_a_message_after_the_stop_began_is_refused_shutting_down() -> None:
    rig = make_rig(lambda r: {"text": "hi"})
    await rig.service.stop(1.0)
    with pytest.raises(Unavailable) as refused:
        await rig.send("too late")
    assert refused.value.reason == "SHUTTING_DOWN"
