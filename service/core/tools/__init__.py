"""The planner's twelve tools (docs/spec/turn-loop.md) and the runner that validates and runs them.

A tool is one unit (``unit.Tool``): name, description, JSON Schema, the permissions it
permissions, whether it writes, the backend RPCs it makes and the shape of its output,
side by side in ``tracker``, ``skills`` and ``knowledge``. ``registry`` lists the twelve
in the order of docs/spec/authority.md; ``runner`` holds the checks around a call (validation,
policy refusal, write cap, deadline) and ``cut`` the 16 KiB cut.

What the model gets back is always JSON text: the tool's own shape, built by its run
function (our shapes, not protobuf JSON, with self-describing keys; optional fields are
left out when empty; descriptions do not spell the shapes out, decision 0295),
``{"error": {"reason": "<UPPER_SNAKE>", "message": "<for the model>"}}``
with the reasons of ``service.core.errors.ToolFailure``, or, too large,
``{"truncated": true, "original_bytes": N, "content": ...}``.

This package imports neither grpc, protobuf nor SQLAlchemy (docs/contributing.md).
"""

from service.core.tools.cut import MAX_RESULT_BYTES, cut_to_fit
from service.core.tools.registry import (
    TOOL_SCHEMA_VERSION,
    TOOLS,
    TOOLS_BY_NAME,
    WRITE_TOOLS,
    declarations,
)
from service.core.tools.runner import (
    DEFAULT_TOOL_TIMEOUT_S,
    ToolContext,
    ToolOutcome,
    ToolRunner,
    error_result,
    parse_arguments,
    touches_policy,
    validate_arguments,
)
from service.core.tools.unit import (
    VALIDATION_ONLY,
    Invocation,
    Tool,
    ToolResult,
    declared_schema,
)

__all__ = [
    "DEFAULT_TOOL_TIMEOUT_S",
    "MAX_RESULT_BYTES",
    "TOOLS",
    "TOOLS_BY_NAME",
    "TOOL_SCHEMA_VERSION",
    "VALIDATION_ONLY",
    "WRITE_TOOLS",
    "Invocation",
    "Tool",
    "ToolContext",
    "ToolOutcome",
    "ToolResult",
    "ToolRunner",
    "cut_to_fit",
    "declarations",
    "declared_schema",
    "error_result",
    "parse_arguments",
    "touches_policy",
    "validate_arguments",
]
