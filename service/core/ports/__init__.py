"""The core's ports: what the turn loop needs from the world, as Protocols, one module per
area:

- ``store``: sessions, transcripts, turns and events (``SessionStore`` and its records);
- ``streams``: the open Chat streams counted across replicas (``StreamStore``);
- ``bus``: cross-replica signals and a stream's view of a session (``Notifier``);
- ``model``: the model-message protocol and the LLM gateway (``ModelGateway``);
- ``backends``: the tracker, skills and knowledge backends (``ToolBackends``);
- ``clock``: wall-clock and monotonic time (``Clock``).

``service/adapters/`` implements them (SQL storage, the gateway and backend clients, the
cross-replica notifier); tests use the in-memory store or the real adapters on the
devstack. Every public name is re-exported here, so ``from service.core.ports import X``
keeps working for code inside and outside the repository.
"""

from __future__ import annotations

from service.core import tracing
from service.core.ports.backends import Acting, ProjectInfo, SkillDocument, ToolBackends
from service.core.ports.bus import Notifier, Subscription
from service.core.ports.clock import Clock
from service.core.ports.model import (
    FinishChunk,
    FinishReason,
    ModelChunk,
    ModelDeadlines,
    ModelGateway,
    ModelMessage,
    ModelRequest,
    Purpose,
    Role,
    TextChunk,
    ToolCall,
    ToolCallChunk,
    ToolCallStartChunk,
    ToolDeclaration,
)
from service.core.ports.store import (
    ContextSnapshot,
    Enqueue,
    LeaseStatus,
    NewSession,
    Promoted,
    Promotion,
    RunningLimits,
    SessionCursor,
    SessionQuery,
    SessionStore,
    StartOutcomeKind,
    SummaryUpdate,
    TurnCommit,
    TurnEnd,
    TurnPatch,
    TurnStart,
    TurnStartOutcome,
)
from service.core.ports.streams import OpenStream, StreamStore

#: Spans without OpenTelemetry; defined in ``service/core/tracing.py`` with its no-op.
Tracer = tracing.Tracer

__all__ = [
    "Acting",
    "Clock",
    "ContextSnapshot",
    "Enqueue",
    "FinishChunk",
    "FinishReason",
    "LeaseStatus",
    "ModelChunk",
    "ModelDeadlines",
    "ModelGateway",
    "ModelMessage",
    "ModelRequest",
    "NewSession",
    "Notifier",
    "OpenStream",
    "ProjectInfo",
    "Promoted",
    "Promotion",
    "Purpose",
    "Role",
    "RunningLimits",
    "SessionCursor",
    "SessionQuery",
    "SessionStore",
    "SkillDocument",
    "StartOutcomeKind",
    "StreamStore",
    "Subscription",
    "SummaryUpdate",
    "TextChunk",
    "ToolBackends",
    "ToolCall",
    "ToolCallChunk",
    "ToolCallStartChunk",
    "ToolDeclaration",
    "Tracer",
    "TurnCommit",
    "TurnEnd",
    "TurnPatch",
    "TurnStart",
    "TurnStartOutcome",
]
