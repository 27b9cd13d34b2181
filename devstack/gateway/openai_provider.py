"""The `openai` provider: any OpenAI-compatible Chat Completions endpoint (README.md).

It speaks through the official SDK (`openai.AsyncOpenAI`), streaming, so it works with
the OpenAI API and with local servers that copy it (vLLM, Ollama, llama.cpp).

Request conversion (`ballet.llm.v1.GenerateRequest` to a Chat Completions body):

- `system_prompt` -> a leading `{"role": "system"}` message (when not empty);
- `system_context` -> a second `{"role": "system"}` message right after it (when not
  empty): chat templates render the tools with or after the first system message, so the
  instructions and tools form a prefix every project shares (decision 0296). With
  `BALLET_OPENAI_SYSTEM_CONTEXT=merged` it is appended to the first system message after
  a blank line instead, for templates that refuse a system message after the first
  (Gemma's, some Mistral ones): the prefix then ends where the project begins;
- user -> `{"role": "user", "content": text}`;
- assistant -> `{"role": "assistant", "content": text or null, "tool_calls": [{"id",
  "type": "function", "function": {"name", "arguments"}}]}` (`tool_calls` only when any;
  a call whose name is not a function name the API takes, empty above all, is sent back
  as `invalid_tool_name`: the model made it so, and its error result says why);
- tool -> `{"role": "tool", "tool_call_id", "content"}`; the result's `is_error` has no
  Chat Completions field: the planner's error results say so in their content;
- tools -> `{"type": "function", "function": {"name", "description", "parameters"}}`
  (none sent for compaction: the API refuses an empty list);
- `stream=True` with `stream_options={"include_usage": True}`; `max_output_tokens` > 0 ->
  `max_tokens` or `max_completion_tokens` (constructor choice);
- model: `GenerateRequest.model` when set, else the provider's default.

Streaming (`devstack.gateway.openai_stream`): the raw SSE body is read, not the SDK's
parsed stream, so that a body cut before `[DONE]` is seen as cut. Text, `refusal` and
reasoning (`reasoning_content` or `reasoning`) deltas are yielded as they arrive; tool
calls are assembled by id where ids are given and by index otherwise and yielded as starts
and argument deltas; usage comes from whichever chunk carries it. Finish reasons: stop ->
STOP (TOOL_CALLS when the answer has calls), tool_calls/function_call -> TOOL_CALLS,
length -> LENGTH, content_filter -> CONTENT_FILTER, a refusal -> REFUSAL, neither a finish
reason nor `[DONE]` -> TRUNCATED.

Errors (`ProviderError`, code / ErrorInfo reason). Provider text in a message is cut to
`ERROR_TEXT_MAX_CHARS` and scrubbed of credentials (`ballet_common.redact`): a 401 body
that quotes the key never leaves the gateway.

- connection failure before an answer -> UNAVAILABLE ("model endpoint unreachable"); a
  stream that breaks off after it began -> UNAVAILABLE (`PROVIDER_STREAM_BROKEN`, "the
  model's stream broke off after N events"); an error event inside the stream ->
  UNAVAILABLE (`PROVIDER_STREAM_ERROR`); a chunk that is not JSON -> UNAVAILABLE
  (`PROVIDER_STREAM_MALFORMED`): the planner retries these while nothing was shown;
- HTTP 5xx -> UNAVAILABLE, with the Retry-After delay of a 503 (capped);
- timeout, HTTP 408 -> DEADLINE_EXCEEDED;
- HTTP 429 -> RESOURCE_EXHAUSTED / RATE_LIMITED with the Retry-After delay (capped at
  `RETRY_AFTER_MAX_S`), or QUOTA_EXCEEDED when the error code or type is
  `insufficient_quota`;
- HTTP 401 -> UNAUTHENTICATED / CREDENTIAL_EXPIRED: the provider refused the project's
  credential. The HTTP answer cannot tell expired from revoked or mistyped, and all need
  the same fix (a new credential), which is the turn failure the planner reports
  (docs/spec/api-and-streams.md); UNAUTHENTICATED is not retried by the planner
  (docs/spec/turn-loop.md);
- HTTP 403 -> PERMISSION_DENIED; 404 -> NOT_FOUND (usually an unknown model or a wrong
  base URL); 400 and 422 -> INVALID_ARGUMENT (reason CONTEXT_LENGTH_EXCEEDED when the
  error code says so, TOOLS_NOT_SUPPORTED when the text says the server cannot serve the
  tools: Ollama, vLLM and llama.cpp each say so in their own words); 409 -> ABORTED;
  other statuses -> UNKNOWN;
- an answer the SDK cannot parse -> INTERNAL.

The SDK's own retries are off (`max_retries=0` by default): the planner retries per
docs/spec/turn-loop.md, and two layers of retries would multiply the attempts and the latency.
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import grpc
import httpx2
import openai
from ballet.llm.v1 import gateway_pb2
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionToolMessageParam,
)

from ballet_common.redact import scrub
from devstack.gateway.base import (
    REASON_CREDENTIAL_EXPIRED,
    REASON_QUOTA_EXCEEDED,
    REASON_RATE_LIMITED,
    ProviderChunk,
    ProviderError,
)
from devstack.gateway.openai_stream import ChunkReader, read_stream

DEFAULT_BASE_URL = "https://api.openai.com/v1"

ENV_BASE_URL = "BALLET_OPENAI_BASE_URL"
ENV_API_KEY = "BALLET_OPENAI_API_KEY"
ENV_MODEL = "BALLET_OPENAI_MODEL"
ENV_TOKEN_LIMIT_PARAM = "BALLET_OPENAI_TOKEN_LIMIT_PARAM"
ENV_TIMEOUT_S = "BALLET_OPENAI_TIMEOUT_S"
ENV_SYSTEM_CONTEXT = "BALLET_OPENAI_SYSTEM_CONTEXT"

# Local OpenAI-compatible servers ignore the key, but the SDK insists on one.
_PLACEHOLDER_API_KEY = "unused"
#: The names the Chat Completions API takes for a function, and what a call with any
#: other name (a model that sent none, or a made-up one) is sent back under.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
INVALID_TOOL_NAME = "invalid_tool_name"

REASON_CONTEXT_LENGTH_EXCEEDED = "CONTEXT_LENGTH_EXCEEDED"
#: A 400 that refuses the request's tools: Ollama's "does not support tools", vLLM's
#: "auto" tool choice requiring --enable-auto-tool-choice, llama.cpp's "tools param
#: requires --jinja flag" (decision 0297).
REASON_TOOLS_NOT_SUPPORTED = "TOOLS_NOT_SUPPORTED"
_REFUSES_TOOLS = re.compile(
    r"does not support tools|tools? (?:are|is) not supported|tool[ _]choice|"
    r"enable-auto-tool-choice|tool-call-parser|tools param requires|--jinja",
    re.IGNORECASE,
)
REASON_MODEL_REQUIRED = "MODEL_REQUIRED"
REASON_INVALID_TOOL_SCHEMA = "INVALID_TOOL_SCHEMA"

REASON_STREAM_BROKEN = "PROVIDER_STREAM_BROKEN"

#: The longest Retry-After passed on to the planner, in seconds: a provider asking for
#: more is told to the planner as this much (the planner then decides not to wait).
RETRY_AFTER_MAX_S = 60.0
#: How much of a provider's error text a status message quotes, in characters.
ERROR_TEXT_MAX_CHARS = 300

TokenLimitParam = Literal["max_tokens", "max_completion_tokens"]
#: Where `GenerateRequest.system_context` goes: its own system message after the first
#: (`message`), or appended to the first (`merged`).
SystemContextMode = Literal["message", "merged"]


class ConfigError(ValueError):
    """The provider's environment settings are missing or invalid; names the variable."""


@dataclass(frozen=True, slots=True)
class OpenAIConfig:
    """Settings of the `openai` provider.

    Attributes:
        base_url: the endpoint's base URL, up to and including `/v1`.
        api_key: the key sent as `Authorization: Bearer`; the devstack uses this one key
            for every `credential_ref`.
        model: the default model, used when `GenerateRequest.model` is empty.
        token_limit_param: which body field carries `max_output_tokens` (OpenAI's
            reasoning models want `max_completion_tokens`; many local servers know only
            `max_tokens`).
        timeout_s: the HTTP timeout of one call, in seconds.
        system_context: where `GenerateRequest.system_context` goes (`SystemContextMode`).
    """

    base_url: str = DEFAULT_BASE_URL
    api_key: str = field(default=_PLACEHOLDER_API_KEY, repr=False)
    model: str = ""
    token_limit_param: TokenLimitParam = "max_tokens"
    timeout_s: float = 600.0
    system_context: SystemContextMode = "message"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OpenAIConfig:
        """Read the settings from the environment.

        Variables: `BALLET_OPENAI_BASE_URL` (else `OPENAI_BASE_URL`, else the OpenAI API),
        `BALLET_OPENAI_API_KEY` (else `OPENAI_API_KEY`; required for the OpenAI API, a
        placeholder is sent to other endpoints), `BALLET_OPENAI_MODEL` (the default
        model), `BALLET_OPENAI_TOKEN_LIMIT_PARAM` (`max_tokens` or
        `max_completion_tokens`), `BALLET_OPENAI_TIMEOUT_S` (seconds, default 600),
        `BALLET_OPENAI_SYSTEM_CONTEXT` (`message`, the default, or `merged`).

        Raises:
            ConfigError: a variable is invalid, or no key is set for the OpenAI API.
        """
        env = os.environ if environ is None else environ
        base_url = env.get(ENV_BASE_URL) or env.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        api_key = env.get(ENV_API_KEY) or env.get("OPENAI_API_KEY") or ""
        if not api_key:
            if base_url.rstrip("/") == DEFAULT_BASE_URL:
                raise ConfigError(
                    f"{ENV_API_KEY} (or OPENAI_API_KEY) is required for {DEFAULT_BASE_URL}; "
                    f"for a local server set {ENV_BASE_URL}"
                )
            api_key = _PLACEHOLDER_API_KEY
        limit_param = env.get(ENV_TOKEN_LIMIT_PARAM) or "max_tokens"
        if limit_param not in ("max_tokens", "max_completion_tokens"):
            raise ConfigError(
                f"{ENV_TOKEN_LIMIT_PARAM} must be max_tokens or max_completion_tokens, "
                f"got {limit_param!r}"
            )
        timeout_text = env.get(ENV_TIMEOUT_S) or "600"
        try:
            timeout_s = float(timeout_text)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise ConfigError(
                f"{ENV_TIMEOUT_S} must be a number of seconds > 0, got {timeout_text!r}"
            )
        token_limit_param: TokenLimitParam = (
            "max_tokens" if limit_param == "max_tokens" else "max_completion_tokens"
        )
        context_mode = env.get(ENV_SYSTEM_CONTEXT) or "message"
        if context_mode not in ("message", "merged"):
            raise ConfigError(
                f"{ENV_SYSTEM_CONTEXT} must be message or merged, got {context_mode!r}"
            )
        system_context: SystemContextMode = "merged" if context_mode == "merged" else "message"
        return cls(
            base_url=base_url,
            api_key=api_key,
            model=env.get(ENV_MODEL, ""),
            token_limit_param=token_limit_param,
            timeout_s=timeout_s,
            system_context=system_context,
        )


class OpenAIProvider:
    """The `openai` provider (see the module docstring for the conversions and errors).

    Args:
        base_url: the endpoint's base URL, e.g. `https://api.openai.com/v1` or
            `http://127.0.0.1:11434/v1`.
        api_key: the bearer key (any non-empty text for servers that ignore it).
        model: the default model, used when the request's `model` is empty.
        token_limit_param: the body field for `max_output_tokens`.
        timeout_s: the HTTP timeout of one call, in seconds.
        max_retries: the SDK's own retries; 0 because the planner retries.
        system_context: where `GenerateRequest.system_context` goes.
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str = "",
        token_limit_param: TokenLimitParam = "max_tokens",
        timeout_s: float = 600.0,
        max_retries: int = 0,
        system_context: SystemContextMode = "message",
    ) -> None:
        self.model = model
        self.system_context: SystemContextMode = system_context
        self.timeout_s = timeout_s
        self.token_limit_param: TokenLimitParam = token_limit_param
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or _PLACEHOLDER_API_KEY,
            timeout=timeout_s,
            max_retries=max_retries,
        )

    @classmethod
    def from_config(cls, config: OpenAIConfig) -> OpenAIProvider:
        """A provider with these settings."""
        return cls(
            base_url=config.base_url,
            api_key=config.api_key,
            model=config.model,
            token_limit_param=config.token_limit_param,
            timeout_s=config.timeout_s,
            system_context=config.system_context,
        )

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._client.close()

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        """Stream one Chat Completions answer as provider chunks, as they arrive.

        Raises:
            ProviderError: see the module docstring for the mapping; INVALID_ARGUMENT
                (`MODEL_REQUIRED`) when neither the request nor the provider names a model,
                (`INVALID_TOOL_SCHEMA`) when a tool's schema is not a JSON object.
        """
        model = request.model or self.model
        if not model:
            raise ProviderError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"no model: the request names none and {ENV_MODEL} is not set",
                reason=REASON_MODEL_REQUIRED,
            )
        messages = chat_messages(request, merged=self.system_context == "merged")
        tools = chat_tools(request)
        limit = request.max_output_tokens if request.max_output_tokens > 0 else None
        use_max_tokens = self.token_limit_param == "max_tokens"
        reader = ChunkReader()
        try:
            # The raw body, not the SDK's parsed stream: only the body tells a stream that
            # ended with [DONE] from one that was cut (openai_stream's module docstring).
            async with self._client.chat.completions.with_streaming_response.create(
                model=model,
                messages=messages,
                tools=tools if tools else openai.omit,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=limit if limit is not None and use_max_tokens else openai.omit,
                max_completion_tokens=(
                    limit if limit is not None and not use_max_tokens else openai.omit
                ),
            ) as response:
                async for chunk in read_stream(response.iter_bytes(), reader):
                    yield chunk
        except openai.OpenAIError as exc:
            raise translate_error(exc) from exc
        except httpx2.TimeoutException as exc:
            raise ProviderError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the model's stream stalled: nothing arrived for {self.timeout_s:g} s "
                f"(after {reader.state.events} events)",
            ) from exc
        except httpx2.HTTPError as exc:
            raise ProviderError(
                grpc.StatusCode.UNAVAILABLE,
                f"the model's stream broke off after {reader.state.events} events: "
                f"{type(exc).__name__}: {exc}",
                reason=REASON_STREAM_BROKEN,
            ) from exc


def _sendable(name: str) -> str:
    return name if _FUNCTION_NAME.fullmatch(name) else INVALID_TOOL_NAME


def chat_messages(
    request: gateway_pb2.GenerateRequest, *, merged: bool = False
) -> list[ChatCompletionMessageParam]:
    """The Chat Completions `messages` of a request (see the module docstring);
    `merged` puts `system_context` in the first system message instead of its own.

    Raises:
        ProviderError: INVALID_ARGUMENT for a message whose role is unspecified.
    """
    messages: list[ChatCompletionMessageParam] = []
    system, context = request.system_prompt, request.system_context
    if merged and context:
        system, context = (f"{system}\n\n{context}" if system else context), ""
    if system:
        messages.append({"role": "system", "content": system})
    if context:
        messages.append({"role": "system", "content": context})
    for index, message in enumerate(request.messages):
        if message.role == gateway_pb2.ROLE_USER:
            messages.append({"role": "user", "content": message.text})
        elif message.role == gateway_pb2.ROLE_ASSISTANT:
            assistant: ChatCompletionAssistantMessageParam = {
                "role": "assistant",
                "content": message.text or (None if message.tool_calls else ""),
            }
            if message.tool_calls:
                calls: list[ChatCompletionMessageFunctionToolCallParam] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": _sendable(call.name), "arguments": call.arguments},
                    }
                    for call in message.tool_calls
                ]
                assistant["tool_calls"] = calls
            messages.append(assistant)
        elif message.role == gateway_pb2.ROLE_TOOL:
            result: ChatCompletionToolMessageParam = {
                "role": "tool",
                "tool_call_id": message.tool_result.tool_call_id,
                "content": message.tool_result.content,
            }
            messages.append(result)
        else:
            raise ProviderError(
                grpc.StatusCode.INVALID_ARGUMENT, f"messages[{index}].role is unspecified"
            )
    return messages


def chat_tools(request: gateway_pb2.GenerateRequest) -> list[ChatCompletionFunctionToolParam]:
    """The Chat Completions `tools` of a request; an empty schema means "no arguments".

    Raises:
        ProviderError: INVALID_ARGUMENT (`INVALID_TOOL_SCHEMA`) naming the tool whose
            schema is not a JSON object.
    """
    tools: list[ChatCompletionFunctionToolParam] = []
    for tool in request.tools:
        schema_text = tool.parameters_json_schema or '{"type":"object","properties":{}}'
        try:
            schema = json.loads(schema_text)
        except json.JSONDecodeError as exc:
            raise _bad_schema(tool.name, f"not JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise _bad_schema(tool.name, "not a JSON object")
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": schema,
                },
            }
        )
    return tools


def _bad_schema(name: str, problem: str) -> ProviderError:
    return ProviderError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the JSON Schema of tool {name!r} is {problem}",
        reason=REASON_INVALID_TOOL_SCHEMA,
    )


def translate_error(exc: openai.OpenAIError) -> ProviderError:
    """The `ProviderError` for an SDK error (see the module docstring for the table)."""
    if isinstance(exc, openai.APITimeoutError):
        return ProviderError(grpc.StatusCode.DEADLINE_EXCEEDED, "the model call timed out")
    if isinstance(exc, openai.APIConnectionError):
        return ProviderError(
            grpc.StatusCode.UNAVAILABLE, f"model endpoint unreachable: {_quoted(str(exc))}"
        )
    if isinstance(exc, openai.APIResponseValidationError):
        return ProviderError(
            grpc.StatusCode.INTERNAL, f"unexpected model answer: {_quoted(str(exc))}"
        )
    if isinstance(exc, openai.APIStatusError):
        return _status_error(exc)
    if isinstance(exc, openai.APIError):
        return ProviderError(
            grpc.StatusCode.UNAVAILABLE, f"model stream failed: {_quoted(exc.message)}"
        )
    return ProviderError(grpc.StatusCode.UNKNOWN, f"model call failed: {_quoted(str(exc))}")


def _quoted(text: str) -> str:
    return scrub(text, ERROR_TEXT_MAX_CHARS)


def _status_error(exc: openai.APIStatusError) -> ProviderError:
    status = exc.status_code
    message = f"model endpoint answered HTTP {status}: {_quoted(exc.message)}"
    codes = {exc.code, exc.type}
    if status == 429:
        if "insufficient_quota" in codes:
            return ProviderError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason=REASON_QUOTA_EXCEEDED
            )
        return ProviderError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            message,
            reason=REASON_RATE_LIMITED,
            retry_after_s=retry_after_s(exc.response.headers),
        )
    if status == 401:
        return ProviderError(
            grpc.StatusCode.UNAUTHENTICATED, message, reason=REASON_CREDENTIAL_EXPIRED
        )
    if status == 403:
        return ProviderError(grpc.StatusCode.PERMISSION_DENIED, message)
    if status == 404:
        return ProviderError(grpc.StatusCode.NOT_FOUND, message)
    if status in (400, 422):
        reason = REASON_CONTEXT_LENGTH_EXCEEDED if "context_length_exceeded" in codes else None
        if reason is None and refuses_tools(exc.message):
            reason = REASON_TOOLS_NOT_SUPPORTED
        return ProviderError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=reason)
    if status == 408:
        return ProviderError(grpc.StatusCode.DEADLINE_EXCEEDED, message)
    if status == 409:
        return ProviderError(grpc.StatusCode.ABORTED, message)
    if status >= 500:
        delay = retry_after_s(exc.response.headers) if status == 503 else None
        return ProviderError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s=delay)
    return ProviderError(grpc.StatusCode.UNKNOWN, message)


def refuses_tools(message: str) -> bool:
    """Whether a 400's text says the server cannot serve the request's tools."""
    return _REFUSES_TOOLS.search(message) is not None


def retry_after_s(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """The delay a 429 or 503 asks for, in seconds, capped at `RETRY_AFTER_MAX_S`; None
    when it names none we can read.

    Reads `retry-after-ms` (OpenAI's precise form), then `retry-after` as seconds or as an
    HTTP date (RFC 9110 section 10.2.3; `now` is the Unix time to count from).
    """
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        seconds: float | None = None
        try:
            seconds = float(value) / divisor
        except ValueError:
            if name == "retry-after":
                seconds = _http_date_delay(value, time.time() if now is None else now)
        if seconds is not None and math.isfinite(seconds) and seconds >= 0:
            return min(seconds, RETRY_AFTER_MAX_S)
    return None


def _http_date_delay(value: str, now: float) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)
