"""Model port: the model-message protocol (messages, requests, streamed chunks) and the
LLM gateway that speaks it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from service.core.model import Usage


class Role(StrEnum):
    """The author of a message sent to the model."""

    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class Purpose(StrEnum):
    """Why the model is called (``ballet.llm.v1.Purpose``)."""

    TURN = "turn"
    COMPACTION = "compaction"


@dataclass(frozen=True)
class ToolCall:
    """A tool call made by the model; ``arguments`` is JSON text, possibly invalid."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ModelMessage:
    """One message of the conversation sent to the model."""

    role: Role
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    tool_name: str = ""
    is_error: bool = False


@dataclass(frozen=True)
class ToolDeclaration:
    """A tool offered to the model: name, description and JSON Schema (JSON text)."""

    name: str
    description: str
    parameters_json_schema: str


@dataclass(frozen=True)
class ModelDeadlines:
    """Seconds allowed for the first delta, between deltas, and in total."""

    first_delta_s: float
    idle_s: float
    total_s: float


@dataclass(frozen=True)
class ModelRequest:
    """One model call through the gateway, metered to ``project_id`` with the
    project's ``credential_ref`` (docs/spec/limits.md).

    ``system_prompt`` is what every project's requests share (the instructions), sent
    before the tools; ``system_context`` what differs between projects and turns (the
    project block, then any summary), sent after them, so a provider's prefix cache of
    the instructions and tools serves every project (decision 0296).
    """

    project_id: str
    credential_ref: str
    model: str
    purpose: Purpose
    system_prompt: str
    messages: Sequence[ModelMessage]
    tools: Sequence[ToolDeclaration]
    request_id: str
    deadlines: ModelDeadlines
    system_context: str = ""
    #: The most tokens the answer may generate (``GenerateRequest.max_output_tokens``);
    #: 0 leaves it to the provider (decision 0291).
    max_output_tokens: int = 0
    #: The planner's estimate of the request's input tokens (not sent; counts against the
    #: turn's token budget when the answer reports no usage).
    input_estimate: int = 0


class FinishReason(StrEnum):
    """Why the model stopped, as the provider said (``ballet.llm.v1.FinishReason``).

    A stream that ends with no finish reason is not an answer: the gateway client raises
    ``ModelFailure`` (``MODEL_STREAM_TRUNCATED``) instead of yielding a ``FinishChunk``.
    """

    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    #: The output token limit cut the answer (its text, or a call's arguments).
    LENGTH = "length"
    #: The provider's filter cut the answer.
    CONTENT_FILTER = "content_filter"
    #: The model refused; the refusal's text came as text.
    REFUSAL = "refusal"
    #: The gateway reported none (an old gateway); treated like ``STOP``.
    UNSPECIFIED = "unspecified"


@dataclass(frozen=True)
class TextChunk:
    """A piece of the answer's text."""

    text: str


@dataclass(frozen=True)
class ToolCallStartChunk:
    """A tool call began streaming: its name is known, its arguments may follow.

    ``index`` is the call's position in the answer (0, 1, ...); the ``ToolCallChunk`` of
    the same call carries the same index.
    """

    index: int
    name: str


@dataclass(frozen=True)
class ToolCallChunk:
    """A complete tool call; ``call.call_id`` is the provider's id (may be empty or
    repeated: the planner gives every call its own id; its name may be empty too).
    ``index`` as in ``ToolCallStartChunk``. ``problem`` is set when the gateway sent the
    call malformed (started but never sent whole): why it cannot run, for the model."""

    call: ToolCall
    index: int = 0
    problem: str = ""
    #: The answer stopped at its output limit inside this call: its arguments are only
    #: their start, and it never runs (decision 0292).
    cut: bool = False


@dataclass(frozen=True)
class FinishChunk:
    """The end of the answer; ``usage`` None when the provider reported none;
    ``model`` the model that answered as the server reported it, "" when it did not."""

    reason: FinishReason
    usage: Usage | None
    model: str = ""


ModelChunk = TextChunk | ToolCallStartChunk | ToolCallChunk | FinishChunk


class ModelGateway(Protocol):
    """The LLM gateway (``ballet.llm.v1``).

    ``stream`` yields chunks and ends after a ``FinishChunk``. It raises ``ModelFailure``
    after its own bounded retries (only before the first delta; docs/spec/turn-loop.md).
    """

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]: ...
