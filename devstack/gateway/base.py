"""The provider port of the devstack LLM gateway: what a model backend yields and raises.

A provider turns one `ballet.llm.v1.GenerateRequest` into a stream of `ProviderChunk`s in
the order the gateway contract fixes (proto `GenerateResponse`): text deltas first, then
complete tool calls, then exactly one `FinishChunk`, always last. The servicer
(`devstack.gateway.service`) converts the chunks to protobuf and meters the usage; providers
know nothing of gRPC servicers, the ledger or the recorded requests.

Failures are raised as `ProviderError`, which carries the gRPC status the gateway answers
with and the `google.rpc.ErrorInfo` reason the planner dispatches on (SPEC section 5:
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

# ErrorInfo reasons a provider may set (google.rpc.ErrorInfo.reason, AIP-193). The planner
# maps the last three to turn failures of the same name (SPEC section 3, TurnEndReason).
REASON_RATE_LIMITED = "RATE_LIMITED"
REASON_QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
REASON_CREDENTIAL_EXPIRED = "CREDENTIAL_EXPIRED"


class FinishReason(enum.Enum):
    """Why the model stopped; mirrors proto `ballet.llm.v1.FinishReason`."""

    UNSPECIFIED = "unspecified"
    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"


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
class ToolCallChunk:
    """One complete tool call: `arguments` is JSON text exactly as the model produced it,
    possibly invalid (the planner turns bad JSON into an error result, SPEC section 5)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class FinishChunk:
    """The end of the answer; `usage` is None when the provider reported none."""

    reason: FinishReason
    usage: Usage | None = None


ProviderChunk = TextChunk | ToolCallChunk | FinishChunk


class ProviderError(Exception):
    """A model call failed; the gateway answers with this status.

    Attributes:
        code: the `grpc.StatusCode` to fail the Generate call with (never OK).
        message: the status message, for humans and logs.
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
    """A model backend of the gateway (SPEC section 9: `scripted`, `openai`, room for more)."""

    def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        """Answer one request as a stream of chunks.

        Implemented as an async generator. Yields zero or more `TextChunk`s, then zero or
        more `ToolCallChunk`s, then exactly one `FinishChunk`. The caller may stop iterating
        early (client cancel) and closes the generator.

        Raises:
            ProviderError: the call failed, before or after some chunks were yielded.
        """
        ...


def new_tool_call_id() -> str:
    """A fresh tool call id, `call_` + 24 hex digits, unique for all practical purposes."""
    return f"call_{secrets.token_hex(12)}"
