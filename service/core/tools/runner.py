"""Running one tool call: the checks, the deadline and the cut, around a tool's ``run``.

docs/spec/authority.md ("a failing tool call ... is returned to the model as an error result,
and the conversation continues"); docs/spec/authority.md (policy refusal, write cap, request ids)
and docs/spec/turn-loop.md step 5 (validation, error results, the 16 KiB cut). ``ToolRunner.run``
checks, in this order:

0. the call names a tool at all (``UNKNOWN_TOOL``: a model may send a call without a
   name; decision 0223);
1. the arguments are a JSON object of well-formed Unicode, nested at most
   ``MAX_ARGUMENT_DEPTH`` deep (``INVALID_ARGUMENTS``; an integral number such as
   ``10.0`` is the integer 10, decision 0131);
2. the tool exists (``UNKNOWN_TOOL``);
3. for ``propose_changeset``, no operation touches an execution policy
   (``POLICY_CHANGE_NOT_ALLOWED``, before anything else is looked at, so the backend
   never sees it);
4. the JSON Schema (``INVALID_ARGUMENTS``, naming the path; unknown fields are rejected,
   and a number beyond the backend field's range is refused here);
5. the turn's write cap (``WRITE_LIMIT_REACHED``);
6. the tool's backend work, within the tool deadline (``DEADLINE_EXCEEDED``).

What the model gets back is always JSON text (``ToolOutcome.content``): the tool's own
shape, ``{"error": {"reason", "message"}}``, or a cut result (``cut.cut_to_fit``).
Nothing here logs an argument value: an unexpected failure is logged at ERROR with the
session id, the tool's name and where it failed (docs/spec/operations.md), its
traceback at DEBUG.
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import PurePath
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

#: The default deadline of one tool's backend work, in seconds (docs/spec/turn-loop.md, Deadlines).
DEFAULT_TOOL_TIMEOUT_S = 10.0
#: The deepest nesting of arrays and objects arguments may have. The deepest schema needs
#: 4 ($.operations[i].create_item); the bound keeps recursive checks far from Python's
#: recursion limit.
MAX_ARGUMENT_DEPTH = 32
# The runner's own timer fires a little after the backend's deadline (at most this much),
# so the backend's DEADLINE_EXCEEDED normally wins and the timer only guards a backend
# that ignores deadlines.
_TIMER_SLACK_S = 0.5
# Error messages from backends are for the model; keep them short.
_MAX_ERROR_MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class ToolContext:
    """Who a tool call acts for and in which project (docs/spec/authority.md).

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
    (``CREDENTIAL_EXPIRED`` ends the turn FAILED at the end of the round; docs/spec/authority.md).
    ``changeset_id`` is set when ``propose_changeset`` proposed one, ``knowledge_entry_id``
    and ``knowledge_version`` when a knowledge entry was written, so the turn loop can emit
    ``changeset_proposed`` / ``knowledge_written`` (docs/spec/authority.md, Containment).
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
    ``CANCELLED``, ``INTERRUPTED``), so every error result has the same shape. The
    message is cut to 1,000 characters, and a lone surrogate (from arguments quoted back)
    becomes ``?``, so the text always encodes as UTF-8.
    """
    if len(message) > _MAX_ERROR_MESSAGE_CHARS:
        message = message[: _MAX_ERROR_MESSAGE_CHARS - 1] + "…"
    message = message.encode("utf-8", "replace").decode("utf-8")
    content = dumps({"error": {"reason": reason, "message": message}})
    return ToolOutcome(content=content, is_error=True, error_reason=reason)


class ToolRunner:
    """Validates and runs tool calls against ``ToolBackends``.

    ``max_result_bytes`` caps a success result in UTF-8 bytes (docs/spec/turn-loop.md step 5);
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
        except Exception as error:
            # A bug here must not end the conversation (docs/spec/authority.md). The arguments
            # may hold human content and any exception text may quote them, so neither is
            # logged above DEBUG (docs/spec/operations.md).
            tool = call.name if call.name in TOOLS_BY_NAME else "(unknown)"
            fields = {"session": context.acting.session_id}
            _log.error("tool %s failed unexpectedly: %s", tool, _where(error), extra=fields)
            _log.debug("tool %s failure", tool, exc_info=True, extra=fields)
            return error_result("BACKEND_ERROR", "the tool failed unexpectedly")

    async def _run(self, call: ToolCall, context: ToolContext) -> ToolOutcome:
        if not call.name:
            raise ToolFailure(
                "UNKNOWN_TOOL",
                "the tool call has no name, so it was not run; the tools are: "
                + ", ".join(TOOLS_BY_NAME),
            )
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
        # deduplicated (docs/spec/authority.md), so make the model look before it tries again.
        return ToolFailure(
            "DEADLINE_EXCEEDED",
            "the backend did not answer in time; the write may or may not have happened: "
            "check (list_changesets or get_knowledge) before trying again",
        )
    return ToolFailure("DEADLINE_EXCEEDED", "the backend did not answer in time")


def _where(error: BaseException) -> str:
    """The exception's type and the innermost frame it was raised in: no message, since
    a message may quote argument values."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return type(error).__name__
    frame = frames[-1]
    where = f"{PurePath(frame.filename).name}:{frame.lineno}"
    return f"{type(error).__name__} in {frame.name} ({where})"


# --------------------------------------------------------------------------- checks


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _number(text: str) -> int | float | Decimal:
    """A JSON number written with a fraction or an exponent: an integer when its value is
    integral (``10.0``, ``1e2``; decision 0131), else a float.

    JSON Schema counts such a number as an integer, so the schema accepts it; the
    backends' integer fields would not, so it becomes one here. The exact decimal value
    decides: ``1.0000000000000000001`` rounds to the float 1.0, which a schema would take
    for an integer, so it stays an exact ``Decimal`` (a number, not an integer).
    Magnitudes beyond 2**64 stay floats (no schema allows them), so a number like
    ``1e999999`` never becomes a huge integer.
    """
    approximate = float(text)
    if not approximate.is_integer() or abs(approximate) > 2**64:
        return approximate
    exact = Decimal(text)
    if exact == exact.to_integral_value():
        return int(exact)
    return exact


def parse_arguments(text: str) -> JsonObject:
    """Parse a tool call's arguments; raises ``ToolFailure`` (``INVALID_ARGUMENTS``) when
    they are not JSON (``NaN`` and ``Infinity`` included), not an object, nested deeper
    than ``MAX_ARGUMENT_DEPTH``, or hold a string that is not well-formed Unicode (a lone
    surrogate escape such as ``"\\ud800"``, which no backend could encode)."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_number)
    except (ValueError, RecursionError) as error:
        raise ToolFailure(
            "INVALID_ARGUMENTS", f"the arguments are not valid JSON: {error}"
        ) from None
    if not isinstance(value, dict):
        raise ToolFailure(
            "INVALID_ARGUMENTS",
            f"the arguments must be a JSON object, not {_json_type(value)}",
        )
    _check_structure(value)
    return value


def _check_structure(arguments: JsonObject) -> None:
    stack: list[tuple[Any, str, int]] = [(arguments, "$", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict | list) and depth > MAX_ARGUMENT_DEPTH:
            raise ToolFailure(
                "INVALID_ARGUMENTS", f"{path}: nested more than {MAX_ARGUMENT_DEPTH} levels deep"
            )
        if isinstance(value, dict):
            for key, child in value.items():
                child_path = f"{path}.{key}" if key.isidentifier() else f"{path}[{key!r}]"
                if not _well_formed(key):
                    raise ToolFailure(
                        "INVALID_ARGUMENTS", f"{child_path}: the key is not valid Unicode"
                    )
                stack.append((child, child_path, depth + 1))
        elif isinstance(value, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(value))
        elif isinstance(value, str) and not _well_formed(value):
            raise ToolFailure(
                "INVALID_ARGUMENTS",
                f"{path}: not valid Unicode (a lone surrogate such as \\ud800)",
            )


def _well_formed(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def touches_policy(arguments: JsonObject) -> bool:
    """True when any key named ``policy`` (or ``*_policy``) appears anywhere in the
    arguments, at any depth (docs/spec/authority.md: the planner cannot set execution policies).

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
    try:
        errors: Sequence[ValidationError] = list(VALIDATORS[tool].iter_errors(arguments))
    except RecursionError:
        raise ToolFailure("INVALID_ARGUMENTS", "$: the arguments are nested too deeply") from None
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
