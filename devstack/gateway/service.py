"""The devstack's `ballet.llm.v1.GatewayService` servicer (README.md).

`Generate` serves only the planner: a call without the planner's service credential for
the gateway's audience (`x-ballet-service-authorization`, a token of the service-token
issuer naming `ballet-llm-gateway` alone) is refused UNAUTHENTICATED
(`SERVICE_CREDENTIAL_MISSING`/`SERVICE_CREDENTIAL_INVALID`), another service's credential
PERMISSION_DENIED (`PLANNER_REQUIRED`), as a production gateway would. It
refuses a request without `project_id` or `credential_ref`, with purpose
unspecified, or with a message whose role is unspecified (INVALID_ARGUMENT); otherwise it
streams the provider's answer as `GenerateResponse` chunks as they come (text deltas,
reasoning activity, tool-call starts and argument deltas), then, when the answer ended
whole (finish STOP or TOOL_CALLS) or at the output limit (LENGTH), the calls in index
order (at the limit, one whose arguments are not a complete JSON object marked `cut`),
then the finish with the model the server reported.
It meters finished calls in the `UsageLedger` (a truncated answer too: the provider
charged for it), and turns a `ProviderError` into a `google.rpc.Status` with exactly one
`ErrorInfo` (domain `llm.ballet`, AIP-193) plus a `RetryInfo` when the provider said
when to retry. Status messages and log lines carry provider text only scrubbed
(`ballet_common.redact`); reasoning text is sent only when the request asks for it and
never logged.

Every request received, refused ones included, is appended to `GatewayServicer.requests`
in arrival order, so tests can assert on exactly what the model saw.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from ballet.llm.v1 import gateway_pb2, gateway_pb2_grpc

from ballet_common.grpc.status import RpcFailure
from ballet_common.redact import scrub
from ballet_common.tokens import GATEWAY_AUDIENCE, PLANNER_SERVICE_SUBJECT, Trust
from devstack.auth import ServiceCredentialVerifier
from devstack.errors import Unauthenticated
from devstack.gateway.base import (
    FinishChunk,
    FinishReason,
    Provider,
    ProviderError,
    ReasoningChunk,
    TextChunk,
    ToolCallChunk,
    ToolCallDeltaChunk,
    ToolCallStartChunk,
    new_tool_call_id,
)
from devstack.gateway.ledger import UsageLedger, UsageRecord

ERROR_DOMAIN = "llm.ballet"
"""The `google.rpc.ErrorInfo.domain` of every error the gateway sends."""

REASON_PROJECT_REQUIRED = "PROJECT_REQUIRED"
REASON_CREDENTIAL_REF_REQUIRED = "CREDENTIAL_REF_REQUIRED"
REASON_PURPOSE_REQUIRED = "PURPOSE_REQUIRED"
REASON_ROLE_REQUIRED = "ROLE_REQUIRED"
REASON_PROVIDER_FAILED = "PROVIDER_FAILED"
REASON_CREDENTIAL_MISSING = "SERVICE_CREDENTIAL_MISSING"
REASON_PLANNER_REQUIRED = "PLANNER_REQUIRED"

_log = logging.getLogger(__name__)

_FINISH_REASONS = {
    FinishReason.UNSPECIFIED: gateway_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: gateway_pb2.FINISH_REASON_STOP,
    FinishReason.TOOL_CALLS: gateway_pb2.FINISH_REASON_TOOL_CALLS,
    FinishReason.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    FinishReason.CONTENT_FILTER: gateway_pb2.FINISH_REASON_CONTENT_FILTER,
    FinishReason.REFUSAL: gateway_pb2.FINISH_REASON_REFUSAL,
    FinishReason.TRUNCATED: gateway_pb2.FINISH_REASON_TRUNCATED,
}
_PURPOSE_NAMES = {
    gateway_pb2.PURPOSE_TURN: "turn",
    gateway_pb2.PURPOSE_COMPACTION: "compaction",
}


def rich_status(error: ProviderError) -> RpcFailure:
    """The status of a provider error: its code and scrubbed message, one ErrorInfo
    (domain `llm.ballet`, reason `error.error_reason`) and, when `retry_after_s` is set, a
    RetryInfo with that delay."""
    return RpcFailure(
        error.code,
        scrub(error.message, 500),
        error.error_reason,
        ERROR_DOMAIN,
        retry_after_s=error.retry_after_s,
    )


def _refusal(request: gateway_pb2.GenerateRequest) -> ProviderError | None:
    def invalid(message: str, reason: str) -> ProviderError:
        return ProviderError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=reason)

    if not request.project_id:
        return invalid(
            "project_id is required: every model call is metered to a project",
            REASON_PROJECT_REQUIRED,
        )
    if not request.credential_ref:
        return invalid(
            "credential_ref is required: the gateway calls with the project's credential",
            REASON_CREDENTIAL_REF_REQUIRED,
        )
    if request.purpose not in _PURPOSE_NAMES:
        return invalid(
            "purpose must be PURPOSE_TURN or PURPOSE_COMPACTION", REASON_PURPOSE_REQUIRED
        )
    for index, message in enumerate(request.messages):
        if message.role == gateway_pb2.ROLE_UNSPECIFIED:
            return invalid(f"messages[{index}].role is unspecified", REASON_ROLE_REQUIRED)
    return None


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """`ballet.llm.v1.GatewayService` over one provider.

    Args:
        provider: the model backend; the public `provider` attribute may be replaced
            between calls (a test switching scenarios).
        trust: the issuers whose service tokens prove the planner (its credential for
            `ballet-llm-gateway`).
        ledger: where finished calls are metered; a fresh `UsageLedger` by default.

    Attributes:
        requests: every `GenerateRequest` received, in arrival order (refused ones too).
        credentials: the `x-ballet-service-authorization` value of each of them (empty
            when absent), in the same order: what a gateway that logs could leak.
        ledger: the usage ledger.
    """

    def __init__(
        self, provider: Provider, *, trust: Trust, ledger: UsageLedger | None = None
    ) -> None:
        self.provider = provider
        self.ledger = ledger if ledger is not None else UsageLedger()
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.credentials: list[str] = []
        self._credential = ServiceCredentialVerifier(trust, GATEWAY_AUDIENCE)

    def reset(self) -> None:
        """Forget the recorded requests and the ledger (between tests sharing a server)."""
        self.requests.clear()
        self.credentials.clear()
        self.ledger.clear()

    def _caller_refusal(self, metadata: list[tuple[str, str | bytes]]) -> ProviderError | None:
        try:
            claims = self._credential.verify(metadata)
        except Unauthenticated as error:
            return ProviderError(
                grpc.StatusCode.UNAUTHENTICATED, error.message, reason=error.reason
            )
        if claims is None:
            return ProviderError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the planner's service credential (x-ballet-service-authorization) is required",
                reason=REASON_CREDENTIAL_MISSING,
            )
        if claims.subject != PLANNER_SERVICE_SUBJECT:
            return ProviderError(
                grpc.StatusCode.PERMISSION_DENIED,
                "only the planner may call the gateway",
                reason=REASON_PLANNER_REQUIRED,
            )
        return None

    async def Generate(
        self,
        request: gateway_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream one answer as it is made, then the complete calls of a whole answer,
        then the finish (always last); see the module docstring and proto
        `GenerateResponse` for the order.

        Errors (status with ErrorInfo, domain `llm.ballet`): INVALID_ARGUMENT for a
        refused request; the provider's status for a `ProviderError`; INTERNAL
        (`PROVIDER_FAILED`) for any other provider failure or a chunk out of order.
        """
        metadata = list(context.invocation_metadata() or ())
        self.requests.append(request)
        self.credentials.append(_header(metadata, "x-ballet-service-authorization"))
        refusal = self._caller_refusal(metadata) or _refusal(request)
        if refusal is not None:
            await self._abort(context, request, refusal)
        error: ProviderError | None = None
        answer = _Answer(include_reasoning_text=request.include_reasoning_text)
        try:
            chunks = self.provider.generate(request)
            try:
                async for chunk in chunks:
                    for response in answer.add(chunk):
                        yield response
            finally:
                # Ends the provider's stream (and its HTTP request) when the client
                # cancels or the provider broke the contract.
                await _close(chunks)
            if answer.finish is None:
                raise _out_of_order("the answer ended without a finish")
        except ProviderError as exc:
            error = exc
        except Exception as exc:
            # A provider bug must still reach the planner as a status it can read. The
            # exception's text may quote provider output, so only its scrubbed form is
            # logged; the frames (no values) go to DEBUG.
            described = scrub(f"{type(exc).__name__}: {exc}")
            _log.error("provider failed: request_id=%s: %s", request.request_id, described)
            _log.debug("provider failure at:\n%s", "".join(traceback.format_tb(exc.__traceback__)))
            error = ProviderError(
                grpc.StatusCode.INTERNAL,
                f"the provider failed: {described}",
                reason=REASON_PROVIDER_FAILED,
            )
        if error is not None:
            await self._abort(context, request, error)
        finish = answer.finish
        assert finish is not None
        self.ledger.record(
            UsageRecord(
                project_id=request.project_id,
                credential_ref=request.credential_ref,
                purpose=_PURPOSE_NAMES[request.purpose],
                model=request.model,
                request_id=request.request_id,
                usage=finish.usage,
            )
        )
        _log.debug(  # one line per model call: the dev terminal keeps them out of sight
            "generate done: project=%s purpose=%s request_id=%s finish=%s usage=%s",
            request.project_id,
            _PURPOSE_NAMES[request.purpose],
            request.request_id,
            finish.reason.value,
            finish.usage,
        )
        if finish.reason.whole or finish.reason is FinishReason.LENGTH:
            # At the output limit the complete calls are sent too, and a call whose
            # arguments are not a complete JSON object is marked cut: the limit stopped
            # inside it (servers such as llama.cpp emit a call only once parsed).
            cut_answer = finish.reason is FinishReason.LENGTH
            for call in answer.calls:
                arguments = "".join(call.arguments)
                yield gateway_pb2.GenerateResponse(
                    tool_call=gateway_pb2.ToolCall(
                        id=call.id,
                        name=call.name,
                        arguments=arguments,
                        cut=cut_answer and not _json_object(arguments),
                    )
                )
        response_finish = gateway_pb2.Finish(
            reason=_FINISH_REASONS[finish.reason],
            provider_reason=finish.provider_reason,
            model=finish.model,
        )
        if finish.usage is not None:
            response_finish.usage.CopyFrom(
                gateway_pb2.Usage(
                    input_tokens=finish.usage.input_tokens,
                    output_tokens=finish.usage.output_tokens,
                )
            )
        yield gateway_pb2.GenerateResponse(finish=response_finish)

    async def _abort(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        request: gateway_pb2.GenerateRequest,
        error: ProviderError,
    ) -> None:
        _log.info(
            "generate failed: project=%s request_id=%s code=%s reason=%s",
            request.project_id,
            request.request_id,
            error.code.name,
            error.error_reason,
        )
        await context.abort_with_status(rich_status(error).to_grpc_status())


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


@dataclass
class _Answer:
    """One answer as the servicer relays it: checks the provider's order, numbers the
    calls and keeps their arguments for the complete calls sent at the end."""

    include_reasoning_text: bool
    calls: list[_Call] = field(default_factory=list)
    finish: FinishChunk | None = None

    def add(self, chunk: object) -> list[gateway_pb2.GenerateResponse]:
        if self.finish is not None:
            raise _out_of_order("a chunk after the finish")
        if isinstance(chunk, TextChunk):
            if not chunk.text:
                return []
            return [gateway_pb2.GenerateResponse(text_delta=gateway_pb2.TextDelta(text=chunk.text))]
        if isinstance(chunk, ReasoningChunk):
            if chunk.characters < 1:
                raise _out_of_order("reasoning activity of no characters")
            text = chunk.text if self.include_reasoning_text else ""
            activity = gateway_pb2.ReasoningActivity(characters=chunk.characters, text=text)
            return [gateway_pb2.GenerateResponse(reasoning=activity)]
        if isinstance(chunk, ToolCallStartChunk):
            return [self._start(chunk.index, chunk.id, chunk.name)]
        if isinstance(chunk, ToolCallDeltaChunk):
            return self._delta(chunk.index, chunk.arguments)
        if isinstance(chunk, ToolCallChunk):
            index = len(self.calls)
            return [self._start(index, chunk.id, chunk.name), *self._delta(index, chunk.arguments)]
        if isinstance(chunk, FinishChunk):
            self.finish = chunk
            return []
        raise _out_of_order(f"an unknown chunk {type(chunk).__name__}")

    def _start(self, index: int, call_id: str, name: str) -> gateway_pb2.GenerateResponse:
        if index != len(self.calls):
            raise _out_of_order(f"tool call {index} started after {len(self.calls)} calls")
        # A call without a name is relayed as the model made it: the planner answers it
        # with an error result, and the answer's other calls still run.
        call = _Call(call_id or new_tool_call_id(), name)
        self.calls.append(call)
        start = gateway_pb2.ToolCallStart(index=index, id=call.id, name=call.name)
        return gateway_pb2.GenerateResponse(tool_call_start=start)

    def _delta(self, index: int, arguments: str) -> list[gateway_pb2.GenerateResponse]:
        if not 0 <= index < len(self.calls):
            raise _out_of_order(f"arguments of tool call {index}, which has not started")
        if not arguments:
            return []
        self.calls[index].arguments.append(arguments)
        delta = gateway_pb2.ToolCallDelta(index=index, arguments=arguments)
        return [gateway_pb2.GenerateResponse(tool_call_delta=delta)]


async def _close(chunks: AsyncIterator[object]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


def _out_of_order(what: str) -> ProviderError:
    return ProviderError(
        grpc.StatusCode.INTERNAL,
        f"the provider broke the gateway contract: {what}",
        reason=REASON_PROVIDER_FAILED,
    )


def _header(metadata: list[tuple[str, str | bytes]], key: str) -> str:
    for name, value in metadata:
        if name == key:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return ""


def add_gateway_service(
    server: grpc.aio.Server,
    provider: Provider,
    *,
    trust: Trust,
    ledger: UsageLedger | None = None,
) -> GatewayServicer:
    """Register a `GatewayServicer` over `provider` on a grpc.aio server (before it
    starts) and return it, so the caller can read its `requests` and `ledger`. `trust`
    names the issuers whose service tokens prove the planner (in dev mode
    `Trust.dev(dev_secret(data_dir))`, the devstack's)."""
    servicer = GatewayServicer(provider, trust=trust, ledger=ledger)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    return servicer


def _json_object(arguments: str) -> bool:
    """Whether ``arguments`` is a complete JSON object."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
