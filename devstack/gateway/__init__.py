"""The devstack's LLM gateway (README.md): `ballet.llm.v1.GatewayService` over a
provider (`scripted`, devstack/gateway/scripted.py, or `openai`), with a per-project usage ledger.

Modules: `base` (the provider port: chunks, `ProviderError`), `scripted`, `openai_provider`
(with `openai_stream`, the Chat Completions stream reader),
`ledger`, `service` (the servicer and `add_gateway_service`). Nothing here does I/O at
import time.
"""

from devstack.gateway.base import (
    FinishChunk,
    FinishReason,
    Provider,
    ProviderChunk,
    ProviderError,
    ReasoningChunk,
    TextChunk,
    ToolCallChunk,
    ToolCallDeltaChunk,
    ToolCallStartChunk,
    Usage,
)
from devstack.gateway.ledger import UsageLedger, UsageRecord, UsageTotals
from devstack.gateway.scripted import Scenario, ScenarioError, ScriptedProvider
from devstack.gateway.service import GatewayServicer, add_gateway_service

__all__ = [
    "FinishChunk",
    "FinishReason",
    "GatewayServicer",
    "Provider",
    "ProviderChunk",
    "ProviderError",
    "ReasoningChunk",
    "Scenario",
    "ScenarioError",
    "ScriptedProvider",
    "TextChunk",
    "ToolCallChunk",
    "ToolCallDeltaChunk",
    "ToolCallStartChunk",
    "Usage",
    "UsageLedger",
    "UsageRecord",
    "UsageTotals",
    "add_gateway_service",
]
