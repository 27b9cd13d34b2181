"""``server.event_loop``: the loop ``serve`` runs on (decision 0390); the start-up heap
frozen out of the garbage collector (decision 0400)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from service.config import ConfigError, load_settings
from service.server.serving import event_loop_runner, freeze_start_up


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


class _Node:
    other: object = None


def test_the_start_up_heap_is_frozen_out_of_the_collector() -> None:
    """Decision 0400: the start-up's garbage is collected, what is left is never scanned
    again."""
    node = _Node()
    node.other = node  # a cycle: only the collector frees it
    collected = weakref.ref(node)
    kept = [_Node()]
    del node
    try:
        frozen = freeze_start_up()
        assert collected() is None
        assert frozen == gc.get_freeze_count() > 0
        assert gc.is_tracked(kept)
        assert not any(seen is kept for seen in gc.get_objects())
    finally:
        gc.unfreeze()
