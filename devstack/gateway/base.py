"""The provider port of the devstack LLM gateway: what a model backend yields and raises.

A provider turns one `ballet.llm.v1.GenerateRequest` into a stream of `ProviderChunk`s as
the model makes them: text deltas, reasoning activity, tool-call starts and argument
deltas (or a tool call whose arguments come whole), in any interleaving, then exactly one
`FinishChunk`, always last. A provider whose upstream stream ended without saying why the
model stopped finishes with `FinishReason.TRUNCATED`. The servicer
(`devstack.gateway.service`) checks the order, numbers the calls, converts the chunks to
protobuf (proto `GenerateResponse`), sends the complete calls when the answer ended whole,
and meters the usage; providers know nothing of gRPC servicers, the ledger or the
recorded requests.

Failures are raised as `ProviderError`, which carries the gRPC status the gateway answers
with and the `google.rpc.ErrorInfo` reason the planner dispatches on (docs/spec/turn-loop.md:
only `UNAVAILABLE`, and `RESOURCE_EXHAUSTED` with reason `RATE_LIMITED`, are retried).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
from ballet.llm.v1 import gateway_pb2

from ballet_common.redact import scrub

# ErrorInfo reasons a provider may set (google.rpc.ErrorInfo.reason, AIP-193). The planner
# maps the last three to turn failures of the same name (docs/spec/api-and-streams.md,
# TurnEndReason).
REASON_RATE_LIMITED = "RATE_LIMITED"
REASON_QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
REASON_CREDENTIAL_EXPIRED = "CREDENTIAL_EXPIRED"

#: The longest status message a provider error carries, in characters.
MESSAGE_MAX_CHARS = 500


class FinishReason(enum.Enum):
    """Why the model stopped; mirrors proto `ballet.llm.v1.FinishReason`."""

    UNSPECIFIED = "unspecified"
    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"
    #: The model refused; the refusal's text came as `TextChunk`s.
    REFUSAL = "refusal"
    #: The upstream stream ended without a finish reason or end marker: the answer is cut.
    TRUNCATED = "truncated"

    @property
    def whole(self) -> bool:
        """True when the answer ended as the model meant it to, so its tool calls are
        complete and may be run (never after `LENGTH`, `CONTENT_FILTER`, `REFUSAL` or
        `TRUNCATED`)."""
        return self in (FinishReason.UNSPECIFIED, FinishReason.STOP, FinishReason.TOOL_CALLS)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage of one model call: all prompt tokens (cached included) and generated ones."""

    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TextChunk:
    """A piece of the answer's text (never empty)."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningChunk:
    """The model reasoned: `characters` of reasoning (>= 1) and, when the provider exposes
    it, the text (sent on only when the request asks for it)."""

    characters: int
    text: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallStartChunk:
    """A tool call began. `index` is its position in the answer (0 for the first call to
    start, then 1, 2, ...); `id` is the provider's id, empty when it gave none (the
    servicer makes one up)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallDeltaChunk:
    """The next piece of the arguments of the started call `index`."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallChunk:
    """One tool call whose arguments came whole (the servicer sends it as a start and one
    delta): `arguments` is JSON text exactly as the model produced it, possibly invalid
    (the planner turns bad JSON into an error result, docs/spec/turn-loop.md)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class FinishChunk:
    """The end of the answer; `usage` is None when the provider reported none;
    `provider_reason` is the upstream finish reason verbatim (empty when none)."""

    reason: FinishReason
    usage: Usage | None = None
    provider_reason: str = ""
    #: The model that answered as the server reported it (a chunk's `model`); "" if none.
    model: str = ""


ProviderChunk = (
    TextChunk
    | ReasoningChunk
    | ToolCallStartChunk
    | ToolCallDeltaChunk
    | ToolCallChunk
    | FinishChunk
)


class ProviderError(Exception):
    """A model call failed; the gateway answers with this status.

    Attributes:
        code: the `grpc.StatusCode` to fail the Generate call with (never OK).
        message: the status message, for humans and logs: scrubbed of anything that looks
            like a credential and cut to `MESSAGE_MAX_CHARS` (`ballet_common.redact`),
            whatever the provider put in it.
        reason: the `google.rpc.ErrorInfo` reason (UPPER_SNAKE, e.g. `RATE_LIMITED`,
            `QUOTA_EXCEEDED`, `CREDENTIAL_EXPIRED`); None means the code's name is used.
        retry_after_s: when known, how long the caller should wait before retrying, in
            seconds; the gateway sends it as a `google.rpc.RetryInfo`.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("a ProviderError cannot carry the OK status")
        if retry_after_s is not None and retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        message = scrub(message, MESSAGE_MAX_CHARS)
        super().__init__(message)
        self.code: grpc.StatusCode = code
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def error_reason(self) -> str:
        """The ErrorInfo reason to send: `reason`, or the status code's name."""
        if self.reason:
            return self.reason
        name: str = self.code.name
        return name

    def __repr__(self) -> str:
        return (
            f"ProviderError(code={self.code.name}, message={self.message!r}, "
            f"reason={self.reason!r}, retry_after_s={self.retry_after_s!r})"
        )


class Provider(Protocol):
    """A model backend of the gateway (README.md: `scripted`, `openai`, room for more)."""

    def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        """Answer one request as a stream of chunks.

        Implemented as an async generator. Yields text, reasoning and tool-call chunks as
        they come (a call's start before its deltas, starts in index order), then exactly
        one `FinishChunk`. The caller may stop iterating early (client cancel) and closes
        the generator.

        Raises:
            ProviderError: the call failed, before or after some chunks were yielded.
        """
        ...


def new_tool_call_id() -> str:
    """A fresh tool call id, `call_` + 24 hex digits, unique for all practical purposes."""
    return f"call_{secrets.token_hex(12)}"
