"""The changesets a session proposed that still wait for the human (docs/spec/compaction.md: "after
a compaction the context also lists, outside the summary, the changesets this session
proposed that are still pending"; decision 0172).

They are read as the human through the planner's own tool layer: ``list_changesets``
with status ``proposed``, run by ``ToolRunner`` like a call of the model (the human's
permissions apply, the backend port stays out of it), newest first, page by page. A
changeset is this session's when the tracker recorded it as made by the planner acting
in this session (``recorded_by`` is ``planner:<session_id>``; docs/spec/authority.md). The read
is bounded (``MAX_PAGES`` of ``PAGE_SIZE``); proposed changesets wait for a human, so a
project rarely has more.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from service.core.context import PendingChangeset, PendingChangesets
from service.core.ids import new_call_id
from service.core.ports.model import ToolCall
from service.core.tools import ToolContext
from service.core.turn.model_call import time_left
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import TurnRun

log = logging.getLogger(__name__)

#: Proposed changesets read per page, and pages at most (small pages stay under the
#: 16 KiB cut of a tool result).
PAGE_SIZE = 20
MAX_PAGES = 10


async def pending_changesets(deps: TurnDependencies, state: TurnRun) -> PendingChangesets:
    """This session's proposed changesets, newest first, read within
    ``dependency_timeout_s`` in all; a stop request (cancel, shutdown, timeout) ends the
    read at once. Never raises but ``CancelledError``: a failure, a timeout or a stop is
    a ``PendingChangesets`` with its ``error``."""
    handle = state.handle
    if handle.stopping:
        return PendingChangesets(error="STOPPED")
    read = asyncio.get_running_loop().create_task(_read(deps, state))
    forget = handle.on_stop(read.cancel)
    try:
        async with asyncio.timeout(deps.settings.dependency_timeout_s):
            await asyncio.wait({read})
    except TimeoutError:
        pass
    finally:
        forget()
        if not read.done():
            read.cancel()
            await asyncio.wait({read})
    if read.cancelled():
        reason = "STOPPED" if handle.stopping else "DEADLINE_EXCEEDED"
        log.warning("pending changesets not read (%s)", reason, extra=state.handle.log_fields())
        return PendingChangesets(error=reason)
    return read.result()


async def _read(deps: TurnDependencies, state: TurnRun) -> PendingChangesets:
    acting = state.handle.acting
    context = ToolContext(
        acting=acting,
        project_id=state.session.project_id,
        reserve_write=_no_writes,
        timeout_s=max(0.0, min(deps.settings.dependency_timeout_s, time_left(deps, state))),
    )
    found: list[PendingChangeset] = []
    token = ""
    for _ in range(MAX_PAGES):
        arguments: dict[str, Any] = {"status": "proposed", "page_size": PAGE_SIZE}
        if token:
            arguments["page_token"] = token
        call = ToolCall(new_call_id(), "list_changesets", json.dumps(arguments))
        outcome = await deps.tools.run(call, context)
        page = _page(outcome.content)
        if outcome.is_error or page is None:
            reason = outcome.error_reason or "UNREADABLE_RESULT"
            log.warning(
                "pending changesets unavailable (%s)", reason, extra=state.handle.log_fields()
            )
            return PendingChangesets(error=reason)
        changesets, token, truncated = page
        found.extend(
            _brief(c)
            for c in changesets
            if isinstance(c, dict)
            and c.get("recorded_by") == acting.actor
            and c.get("status", "proposed") == "proposed"
        )
        if truncated:
            return PendingChangesets(tuple(found), complete=False)
        if not token:
            return PendingChangesets(tuple(found))
    return PendingChangesets(tuple(found), complete=False)


def _no_writes() -> bool:
    return False


def _page(content: str) -> tuple[list[Any], str, bool] | None:
    """The changesets of one ``list_changesets`` result, its next page token, and whether
    the 16 KiB cut shortened it (``{"truncated": true, "content": ...}``)."""
    try:
        value = json.loads(content)
    except ValueError:
        return None
    truncated = isinstance(value, dict) and value.get("truncated") is True
    if truncated:
        value = value.get("content")
    if not isinstance(value, dict) or not isinstance(value.get("changesets"), list):
        return None
    token = value.get("next_page_token")
    return value["changesets"], token if isinstance(token, str) else "", truncated


def _brief(changeset: dict[str, Any]) -> PendingChangeset:
    operations = changeset.get("operations")
    return PendingChangeset(
        changeset_id=str(changeset.get("changeset_id", "")),
        title=str(changeset.get("title", "")),
        operations=tuple(
            _operation(o) for o in (operations if isinstance(operations, list) else [])
        ),
    )


def _operation(operation: Any) -> str:
    """One operation in brief, from the shapes ``propose_changeset`` takes."""
    if not isinstance(operation, dict) or len(operation) != 1:
        return "an operation"
    ((key, fields),) = operation.items()
    kind = str(key)
    if not isinstance(fields, dict):
        return kind.replace("_", " ")
    if kind == "create_item":
        ref = f" as {fields['ref']}" if fields.get("ref") else ""
        title = " ".join(str(fields.get("title", "")).split())[:120]
        return f'create {fields.get("kind", "item")} "{title}"{ref}'
    if kind == "update_item":
        changed = ", ".join(sorted(k for k in fields if k != "item_id")) or "no fields"
        return f"update {fields.get('item_id', '?')}: {changed}"
    if kind in ("add_dependency", "remove_dependency"):
        verb = "" if kind == "add_dependency" else "no longer "
        return f"{fields.get('item_id', '?')} {verb}blocked by {fields.get('blocked_by_id', '?')}"
    return kind.replace("_", " ")
