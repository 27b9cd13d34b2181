"""``server.event_loop``: the loop ``serve`` runs on (decision 0390)."""

from __future__ import annotations

import asyncio

import pytest

from service.config import ConfigError, load_settings
from service.server.serving import event_loop_runner


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_the_default_and_asyncio_can_be_chosen() -> None:
    assert load_settings(environ={}).server.event_loop == "uvloop"
    assert event_loop_runner("uvloop")(_loop_module()).startswith("uvloop")
    chosen = load_settings(environ={"BALLET_PLANNER__SERVER__EVENT_LOOP": "asyncio"})
    assert event_loop_runner(chosen.server.event_loop)(_loop_module()).startswith("asyncio")


def test_another_loop_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"server\.event_loop"):
        load_settings(environ={"BALLET_PLANNER__SERVER__EVENT_LOOP": "trio"})
    with pytest.raises(ValueError, match="unknown event loop"):
        event_loop_runner("trio")
