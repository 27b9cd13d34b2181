"""``ballet-planner serve`` as a process: start the planner, serve until SIGTERM or
SIGINT, then stop within ``server.grace_s`` (docs/spec/operations.md; decision 0181), or at once
on a second signal (``ballet_common.signals``; decision 0185).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from ballet_common import datadir
from ballet_common.readyfile import remove_ready_file, write_ready_file
from ballet_common.signals import StopSignals, signal_name, stop_when_signalled
from ballet_common.signals import stopping_message as stopping_text
from service.config import Settings
from service.server.root import PlannerApp, StartupError, planner_tracing, start_planner

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def event_loop_runner(name: str) -> Callable[[Coroutine[Any, Any, _T]], _T]:
    """The function that runs ``serve`` to completion on a new event loop:
    ``uvloop.run`` for ``"uvloop"`` (the default of ``server.event_loop``; decision
    0390: libuv's loop runs the callbacks of gRPC's completion queue, psycopg's socket
    waits and the turn's tasks for about 6% less CPU per turn), else
    ``asyncio.run``. Raises ``ValueError`` for another name (the settings allow none)."""
    if name == "uvloop":
        import uvloop

        return uvloop.run
    if name == "asyncio":
        return asyncio.run
    raise ValueError(f"unknown event loop {name!r}: uvloop or asyncio")


async def serve(settings: Settings, ready_file: Path | None = None) -> int:
    """Run the planner until SIGTERM or SIGINT, then shut down within
    ``server.grace_s`` (docs/spec/operations.md; decision 0181). A second signal during the
    shutdown skips to its end (``ballet_common.signals``; decision 0185). Returns the
    exit code: 0, or ``128 + signum`` when a second signal hurried the stop.

    ``ready_file``: once serving, the bound ``address`` and ``metrics_address`` are
    written there as JSON (``ballet_common.readyfile``), and removed at the stop.

    On SQLite the data directory is held for the life of the process, as ``dev`` holds
    it (decision 0229): raises ``StartupError`` when another ``serve`` or ``dev`` holds
    it, before anything starts."""
    if settings.database.is_sqlite:
        held = datadir.hold(settings.data_dir, "serve")
        if isinstance(held, str):
            raise StartupError(f"{held} (SQLite is for one process)")
    app = await start_planner(settings, tracing=planner_tracing(settings))
    log.debug("%d objects of the start-up frozen out of the garbage collector", freeze_start_up())
    if settings.database.is_sqlite and isinstance(datadir.hold(settings.data_dir, "serve"), str):
        # A folder this start created, taken meanwhile by another start on it.
        log.warning("another ballet-planner holds the data directory too")

    def stopping(signum: int) -> None:
        log.info("%s: %s", signal_name(signum), stopping_message(app))

    with StopSignals("ballet-planner") as signals:
        # Said once the signals are handled: a stop asked for from now on is graceful.
        log.info(
            "ballet-planner serving on %s (metrics %s, replica %s, event loop %s)",
            app.address,
            app.metrics_address or "off",
            settings.server.replica_id,
            type(asyncio.get_running_loop()).__module__.partition(".")[0],
        )
        if settings.dev_mode:
            await warn_of_missing_dependencies(settings)
        try:
            if ready_file is not None:
                write_ready_file(
                    ready_file,
                    {"address": app.address, "metrics_address": app.metrics_address},
                )
            return await stop_when_signalled(signals, app.stop, on_stop=stopping)
        finally:
            # Whatever ended the wait (a failure, a cancelled task), nothing outlives it.
            remove_ready_file(ready_file)
            await app.stop(0 if signals.hurried.is_set() else None)


def freeze_start_up() -> int:
    """Collect the start-up's garbage, then move every object still alive (the modules,
    the classes, the wiring: about 130,000 in ``serve``) to the garbage collector's
    permanent generation, which no collection scans (``gc.freeze``; decision 0400).
    Returns how many objects are frozen.

    Without it every full collection walks that heap: about 110 ms, twice in a thousand
    one-round turns on this project's 2-core machines, a pause for every stream of the
    process and 0.2 ms of CPU a turn on average. What the start-up made is never
    garbage later in a way that matters: the process keeps it for its life."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


#: Seconds a dev-mode start waits to learn whether anything listens at a dependency.
DEPENDENCY_PROBE_S = 0.5


async def warn_of_missing_dependencies(settings: Settings) -> None:
    """In dev mode, one WARNING naming each dependency address where nothing listens,
    and what to start there: readiness follows the database only (a missing dependency
    fails chats, not the process), so without this the first sign is a failed chat."""
    by_address: dict[str, list[str]] = {}
    deps = settings.dependencies
    for name, channel in (
        ("tracker", deps.tracker),
        ("skills", deps.skills),
        ("knowledge", deps.knowledge),
        ("gateway", deps.gateway),
    ):
        by_address.setdefault(channel.address, []).append(name)
    for address, names in by_address.items():
        host, _, port = address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), DEPENDENCY_PROBE_S
            )
        except (OSError, ValueError, TimeoutError):
            log.warning(
                "dependencies: nothing answers at %s (%s): chats fail until it does; for "
                "development start `python -m devstack` there, or run `ballet-planner dev` "
                "instead of serve, which starts both",
                address,
                ", ".join(names),
            )
            continue
        writer.close()


def stopping_message(app: PlannerApp) -> str:
    """What a graceful stop of ``app`` waits for, for the log
    (``ballet_common.signals.stopping_message``)."""
    grace, running = app.settings.server.grace_s, app.running_turns
    return stopping_text(
        grace, running, app.turns_end_within_s, "a second SIGINT or SIGTERM stops at once"
    )
