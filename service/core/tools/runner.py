"""Running one tool call: the checks, the deadline and the cut, around a tool's ``run``.

Seed: Authority ("a failing tool call ... is returned to the model as an error result,
and the conversation continues"); SPEC section 4 (policy refusal, write cap, request ids)
and section 5 step 5 (validation, error results, the 16 KiB cut). ``ToolRunner.run``
checks, in this order:

1. the arguments are a JSON object (``INVALID_ARGUMENTS``);
2. the tool exists (``UNKNOWN_TOOL``);
3. for ``propose_changeset``, no operation touches an execution policy
   (``POLICY_CHANGE_NOT_ALLOWED``, before anything else is looked at, so the backend
   never sees it);
4. the JSON Schema (``INVALID_ARGUMENTS``, naming the path; unknown fields are rejected);
5. the turn's write cap (``WRITE_LIMIT_REACHED``);
6. the tool's backend work, within the tool deadline (``DEADLINE_EXCEEDED``).

What the model gets back is always JSON text (``ToolOutcome.content``): the tool's own
shape, ``{"error": {"reason", "message"}}``, or a cut result (``cut.cut_to_fit``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import ValidationError, best_match

from service.core.backend_types import Acting
from service.core.errors import ToolFailure
from service.core.model import JsonObject
from service.core.ports import ToolBackends, ToolCall
from service.core.tools.cut import MAX_RESULT_BYTES, cut_to_fit, dumps
from service.core.tools.registry import TOOLS_BY_NAME, VALIDATORS
from service.core.tools.tracker import PROPOSE_CHANGESET
from service.core.tools.unit import Invocation, Tool

_log = logging.getLogger(__name__)

#: The default deadline of one tool's backend work, in seconds (SPEC section 5, Deadlines).
DEFAULT_TOOL_TIMEOUT_S = 10.0
# The runner's own timer fires a little after the backend's deadline (at most this much),
# so the backend's DEADLINE_EXCEEDED normally wins and the timer only guards a backend
# that ignores deadlines.
_TIMER_SLACK_S = 0.5
# Error messages from backends are for the model; keep them short.
_MAX_ERROR_MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class ToolContext:
    """Who a tool call acts for and in which project (seed: Authority; SPEC section 4).

    ``reserve_write`` is the turn's write counter (``planner.max_writes_per_turn``): a write
    tool calls it once, after validation and before any backend call, and gets
    ``WRITE_LIMIT_REACHED`` when it returns False. ``timeout_s``, when set, is what is left
    of the turn's budget in seconds; it caps the runner's own tool deadline.
    """

    acting: Acting
    project_id: str
    reserve_write: Callable[[], bool]
    timeout_s: float | None = None


@dataclass(frozen=True)
class ToolOutcome:
    """A tool call's result for the model, and what it wrote.

    ``content`` is JSON text (at most ``max_result_bytes`` UTF-8 bytes for a success);
    ``is_error`` marks ``{"error": ...}`` results and ``error_reason`` repeats their reason
    (``CREDENTIAL_EXPIRED`` ends the turn FAILED at the end of the round; SPEC section 4).
    ``changeset_id`` is set when ``propose_changeset`` proposed one, ``knowledge_entry_id``
    and ``knowledge_version`` when a knowledge entry was written, so the turn loop can emit
    ``changeset_proposed`` / ``knowledge_written`` (SPEC section 4, Containment).
    """

    content: str
    is_error: bool = False
    error_reason: str = ""
    changeset_id: str = ""
    knowledge_entry_id: str = ""
    knowledge_version: int = 0


def error_result(reason: str, message: str) -> ToolOutcome:
    """An error result: ``{"error": {"reason": reason, "message": message}}``.

    The turn loop uses it too, for calls it refuses or abandons (``TOO_MANY_CALLS``,
    ``CANCELLED``, ``INTERRUPTED``), so every error result has the same shape.
    """
    if len(message) > _MAX_ERROR_MESSAGE_CHARS:
        message = message[: _MAX_ERROR_MESSAGE_CHARS - 1] + "…"
    content = dumps({"error": {"reason": reason, "message": message}})
    return ToolOutcome(content=content, is_error=True, error_reason=reason)


class ToolRunner:
    """Validates and runs tool calls against ``ToolBackends``.

    ``max_result_bytes`` caps a success result in UTF-8 bytes (SPEC section 5 step 5);
    ``timeout_s`` is each call's backend deadline in seconds (the tool-call deadline of the
    configuration), further capped by ``ToolContext.timeout_s``. Raises ``ValueError`` for
    a limit below 256 bytes or a deadline that is not positive.
    """

    def __init__(
        self,
        backends: ToolBackends,
        *,
        max_result_bytes: int = MAX_RESULT_BYTES,
        timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
    ) -> None:
        if max_result_bytes < 256:
            raise ValueError("max_result_bytes must be at least 256")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._backends = backends
        self._max_result_bytes = max_result_bytes
        self._timeout_s = timeout_s

    async def run(self, call: ToolCall, context: ToolContext) -> ToolOutcome:
        """Run one tool call and return its outcome; never raises, except
        ``asyncio.CancelledError`` (the turn was cancelled: the caller decides what the
        model sees). ``call.call_id`` is the planner's id of the call; write RPCs send it
        as their ``request_id``. See the module docstring for the order of checks.
        """
        try:
            return await self._run(call, context)
        except ToolFailure as failure:
            return error_result(failure.reason, failure.message)
        except Exception:
            # A bug here must not end the conversation (seed: Authority); log without the
            # arguments, which may hold human content (SPEC section 8).
            _log.exception("tool %s failed unexpectedly", call.name)
            return error_result("BACKEND_ERROR", "the tool failed unexpectedly")

    async def _run(self, call: ToolCall, context: ToolContext) -> ToolOutcome:
        arguments = parse_arguments(call.arguments)
        tool = TOOLS_BY_NAME.get(call.name)
        if tool is None:
            raise ToolFailure(
                "UNKNOWN_TOOL",
                f"there is no tool named {call.name!r}; the tools are: " + ", ".join(TOOLS_BY_NAME),
            )
        if tool is PROPOSE_CHANGESET and touches_policy(arguments):
            raise ToolFailure(
                "POLICY_CHANGE_NOT_ALLOWED",
                "the planner cannot set or change execution policies; only a human can. "
                "Propose the changeset without any policy.",
            )
        validate_arguments(tool.name, arguments)
        if tool.is_write and not context.reserve_write():
            raise ToolFailure(
                "WRITE_LIMIT_REACHED",
                "this turn has made as many writes as it may; tell the human what is left "
                "to do, and continue after their next message",
            )
        timeout_s = self._timeout_s
        if context.timeout_s is not None:
            timeout_s = min(timeout_s, context.timeout_s)
        if timeout_s <= 0:
            raise ToolFailure("DEADLINE_EXCEEDED", "no time is left in this turn for the tool")
        invocation = Invocation(
            backends=self._backends,
            acting=context.acting,
            project_id=context.project_id,
            request_id=call.call_id,
            timeout_s=timeout_s,
        )
        try:
            async with asyncio.timeout(timeout_s + min(_TIMER_SLACK_S, timeout_s / 2)):
                result = await tool.run(invocation, arguments)
        except TimeoutError:
            raise _deadline(tool) from None
        except ToolFailure as failure:
            if failure.reason == "DEADLINE_EXCEEDED":
                raise _deadline(tool) from None
            raise
        return ToolOutcome(
            content=cut_to_fit(result.output, self._max_result_bytes),
            changeset_id=result.changeset_id,
            knowledge_entry_id=result.knowledge_entry_id,
            knowledge_version=result.knowledge_version,
        )


def _deadline(tool: Tool) -> ToolFailure:
    if tool.is_write:
        # The write may have happened; a new call has a new request id and would not be
        # deduplicated (SPEC section 4), so make the model look before it tries again.
        return ToolFailure(
            "DEADLINE_EXCEEDED",
            "the backend did not answer in time; the write may or may not have happened: "
            "check (list_changesets or get_knowledge) before trying again",
        )
    return ToolFailure("DEADLINE_EXCEEDED", "the backend did not answer in time")


# --------------------------------------------------------------------------- checks


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_arguments(text: str) -> JsonObject:
    """Parse a tool call's arguments; raises ``ToolFailure`` (``INVALID_ARGUMENTS``) when
    they are not JSON (``NaN`` and ``Infinity`` included) or not an object."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:
        raise ToolFailure(
            "INVALID_ARGUMENTS", f"the arguments are not valid JSON: {error}"
        ) from None
    if not isinstance(value, dict):
        raise ToolFailure(
            "INVALID_ARGUMENTS",
            f"the arguments must be a JSON object, not {_json_type(value)}",
        )
    return value


def touches_policy(arguments: JsonObject) -> bool:
    """True when any key named ``policy`` (or ``*_policy``) appears anywhere in the
    arguments, at any depth (SPEC section 4: the planner cannot set execution policies).

    The schema does not offer such a key, but this check runs first so that the refusal
    says why, and so that no policy can reach a backend whatever the schema allows.
    """
    stack: list[Any] = [arguments]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            for key, child in value.items():
                if key == "policy" or key.endswith("_policy"):
                    return True
                stack.append(child)
        elif isinstance(value, list):
            stack.extend(value)
    return False


def validate_arguments(tool: str, arguments: JsonObject) -> None:
    """Validate against the tool's JSON Schema; raises ``ToolFailure``
    (``INVALID_ARGUMENTS``) naming the JSON path of the most relevant error, e.g.
    ``$.operations[0].create_item: 'title' is a required property``."""
    errors: Sequence[ValidationError] = list(VALIDATORS[tool].iter_errors(arguments))
    if not errors:
        return
    error = best_match(errors)
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    raise ToolFailure("INVALID_ARGUMENTS", f"{error.json_path}: {error.message}{more}")


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null"
