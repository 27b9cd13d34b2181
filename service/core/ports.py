"""The core's ports: what the turn loop needs from the world, as Protocols (docs/contributing.md).

``service/adapters/`` implements them (SQL storage, the gateway and backend clients, the
cross-replica notifier); tests use in-memory fakes or the real adapters on the devstack.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Protocol

from service.core import backend_types as backend
from service.core import tracing
from service.core.model import (
    ContextEstimate,
    Message,
    Session,
    SessionEvent,
    Turn,
    TurnEndReason,
    Usage,
)

#: Defined with the backends' other types; named here too, where the ports' users look.
Acting = backend.Acting
ProjectInfo = backend.ProjectInfo
SkillDocument = backend.SkillDocument
#: Spans without OpenTelemetry; defined in ``service/core/tracing.py`` with its no-op.
Tracer = tracing.Tracer

# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class NewSession:
    """A session to create; ``request_hash`` fingerprints the payload (AIP-155)."""

    session_id: str
    project_id: str
    organization_id: str
    owner_id: str
    title: str
    request_id: str
    request_hash: str
    now: datetime


@dataclass(frozen=True)
class SessionCursor:
    """Where a page of sessions ends: newest first, ties by id (docs/spec/api-and-streams.md)."""

    create_time: datetime
    session_id: str


@dataclass(frozen=True)
class SessionQuery:
    """Sessions of a project; ``owner_id`` None means every owner (service principals)."""

    project_id: str
    organization_id: str
    owner_id: str | None
    page_size: int
    after: SessionCursor | None = None


@dataclass(frozen=True)
class RunningLimits:
    """Running turns allowed at once, across replicas (docs/spec/limits.md)."""

    per_human: int = 4
    per_project: int = 20


@dataclass(frozen=True)
class TurnStart:
    """Step 1 of the turn loop: the human message and the turn row, in one transaction.

    ``message`` is the human message (sequence 0: the store numbers it) and ``events``
    are ``message_accepted`` and ``turn_started`` (the first carries ``message``).
    ``turn`` is the new running turn with its owner and lease.
    """

    turn: Turn
    project_id: str
    message: Message
    events: Sequence[SessionEvent]
    limits: RunningLimits
    now: datetime


class StartOutcomeKind(StrEnum):
    """What ``start_turn`` did."""

    STARTED = "started"
    #: The (session, request_id) pair was seen before with the same payload.
    DUPLICATE = "duplicate"
    #: A running turn's lease has expired: close it INTERRUPTED, then try again.
    EXPIRED_TURN = "expired_turn"


@dataclass(frozen=True)
class TurnStartOutcome:
    """The result of ``start_turn``.

    STARTED: ``turn`` is the new turn, ``events`` the stored events, numbered.
    DUPLICATE: ``turn`` is the original turn, ``events`` holds its stored
    ``message_accepted`` event. EXPIRED_TURN: ``turn`` is the expired running turn.
    """

    kind: StartOutcomeKind
    turn: Turn
    events: Sequence[SessionEvent] = ()


@dataclass(frozen=True)
class TurnPatch:
    """Absolute new values for a turn's columns; None leaves a column unchanged.

    ``end_reason`` set means the turn ends now (state ENDED, ``end_time`` = commit's now).
    """

    rounds: int | None = None
    usage: Usage | None = None
    compaction_usage: Usage | None = None
    writes: int | None = None
    instructions_version: str | None = None
    tool_schema_version: str | None = None
    skill_name: str | None = None
    skill_version: str | None = None
    model: str | None = None
    end_reason: TurnEndReason | None = None
    error_reason: str | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class SummaryUpdate:
    """A new compaction summary covering the messages up to sequence ``up_to``."""

    summary: str
    up_to: int


@dataclass(frozen=True)
class TurnCommit:
    """One transaction of a running turn (docs/spec/turn-loop.md; at most 4 per one-round turn).

    The store numbers ``events`` from the session counter, inserts them and their
    messages, applies ``turn_patch``, sets ``summary`` and ``context`` on the session, and
    notifies other replicas after commit. When ``context`` is None the store adds the
    estimated tokens of the stored messages to the session's ``pending_tokens`` instead.

    Conditions, checked in the transaction (``StoreConflict`` and nothing stored when one
    fails): the turn is RUNNING; when ``owner`` is set, that replica owns it; when
    ``lease_expired_before`` is set, its lease expired before that time (the sweeper's
    takeover).
    """

    session_id: str
    turn_id: str
    now: datetime
    events: Sequence[SessionEvent] = ()
    turn_patch: TurnPatch | None = None
    summary: SummaryUpdate | None = None
    context: ContextEstimate | None = None
    owner: str | None = None
    lease_expired_before: datetime | None = None


@dataclass(frozen=True)
class LeaseStatus:
    """The result of a lease renewal: ``held`` false means another replica took over."""

    held: bool
    cancel_requested: bool = False


@dataclass(frozen=True)
class ContextSnapshot:
    """What the model will see: the session (summary, estimate) and the messages after
    the summary's ``up_to``, in sequence order (docs/spec/compaction.md)."""

    session: Session
    messages: Sequence[Message]


class SessionStore(Protocol):
    """Sessions, transcripts, turns and events (docs/spec/api-and-streams.md, docs/spec/turn-loop.md
    and docs/spec/storage.md).

    Every method is one unit of work. Failures to reach the database raise
    ``StoreUnavailable``; domain refusals raise ``PlannerError`` subclasses with the
    reasons named below.
    """

    async def ping(self) -> None:
        """Check the database answers; raises ``StoreUnavailable``."""
        ...

    async def create_session(self, new: NewSession) -> Session:
        """Create a session, or return the one created before with the same (owner,
        request_id) and payload; a different payload raises ``InvalidArgument``
        (``REQUEST_ID_REUSED``)."""
        ...

    async def get_session(self, session_id: str) -> Session | None:
        """The session, or None."""
        ...

    async def list_sessions(
        self, query: SessionQuery
    ) -> tuple[list[Session], SessionCursor | None]:
        """One page of sessions, newest first, ties by id, and the next cursor."""
        ...

    async def update_session_title(
        self, session_id: str, title: str, now: datetime
    ) -> Session | None:
        """Set the title; None when the session does not exist."""
        ...

    async def delete_session(self, session_id: str) -> bool:
        """Remove the session, its messages, events, turns and idempotency keys in one
        transaction; False when it did not exist."""
        ...

    async def list_messages(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[Message]:
        """Up to ``limit`` messages with a greater sequence, in sequence order."""
        ...

    async def events_after(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[SessionEvent]:
        """Up to ``limit`` session events with a greater sequence, in order (replay)."""
        ...

    async def get_turn(self, turn_id: str) -> Turn | None:
        """The turn, or None."""
        ...

    async def turn_messages(self, turn_id: str) -> list[Message]:
        """The messages of one turn, in sequence order."""
        ...

    def load_context(self, session_id: str) -> Awaitable[ContextSnapshot | None]:
        """The session and the messages after its summary; None when it is gone. (An
        awaitable, not a coroutine: a store that holds the context answers without a
        task.)"""
        ...

    async def start_turn(self, start: TurnStart) -> TurnStartOutcome:
        """Store the human message and open the turn, in one transaction.

        In order: the (session, request_id) duplicate check (a different payload raises
        ``InvalidArgument``/``REQUEST_ID_REUSED``); a running turn whose lease holds
        raises ``FailedPrecondition``/``TURN_IN_PROGRESS`` (as does losing the race on
        the partial unique index), one whose lease expired gives EXPIRED_TURN; the
        running-turn limits raise ``ResourceExhausted``/``TOO_MANY_TURNS``; a missing
        session raises ``NotFound``.
        """
        ...

    async def commit(self, commit: TurnCommit) -> list[SessionEvent]:
        """Apply one ``TurnCommit``; returns its events, numbered. See ``TurnCommit``."""
        ...

    async def renew_lease(self, turn_id: str, owner: str, until: datetime) -> LeaseStatus:
        """Extend the lease of a running turn ``owner`` holds."""
        ...

    async def request_cancel(self, turn_id: str) -> Turn | None:
        """Flag a running turn cancelled and notify its owner; returns the turn as
        stored (ended turns unchanged), None when unknown."""
        ...

    async def running_turns(
        self, *, owner: str | None = None, lease_expired_before: datetime | None = None
    ) -> list[Turn]:
        """Running turns, optionally only ``owner``'s or only those whose lease expired."""
        ...


@dataclass(frozen=True)
class OpenStream:
    """One open Chat stream as the cross-replica count sees it (docs/spec/limits.md)."""

    stream_id: str
    human_id: str
    replica_id: str
    opened_at: datetime


class StreamStore(Protocol):
    """The open Chat streams of every replica, counted per human across replicas
    (docs/spec/limits.md: at most 16 per human), as rows rather than connections: an idle stream
    costs a row, never a database connection (docs/decisions/0080-cross-replica-stream- count.md). A
    replica's rows count only while its heartbeat lease holds."""

    async def heartbeat(self, replica_id: str, lease_expires_at: datetime) -> bool:
        """Extend ``replica_id``'s lease, creating its row when missing; False when the
        row was missing (first beat, or swept after a lapse: its streams are gone)."""
        ...

    async def open_stream(self, stream: OpenStream, *, limit: int, now: datetime) -> bool:
        """Record ``stream`` unless its human already has ``limit`` streams on replicas
        whose lease holds at ``now``; False (nothing stored) when refused. The count and
        the insert are atomic across replicas."""
        ...

    async def close_streams(self, stream_ids: Sequence[str]) -> None:
        """Forget streams; unknown ids are ignored."""
        ...

    async def restore_streams(self, replica_id: str, streams: Sequence[OpenStream]) -> None:
        """Re-record a replica's open streams after its rows were swept (a lapse)."""
        ...

    async def replica_streams(self, replica_id: str) -> list[str]:
        """The ids of the streams recorded for ``replica_id`` (its heartbeat checks them
        against the streams open on it, decision 0182)."""
        ...

    async def remove_replica(self, replica_id: str) -> None:
        """Forget a replica and its streams (start-up of a reused id, shutdown)."""
        ...

    async def sweep_replicas(self, now: datetime) -> int:
        """Forget replicas whose lease expired before ``now`` and their streams; returns
        how many replicas were forgotten."""
        ...


# --------------------------------------------------------------------------- events


class Subscription(Protocol):
    """A stream's view of one session's events: session events and text deltas."""

    def __aiter__(self) -> AsyncIterator[SessionEvent | object]: ...

    def close(self) -> None: ...


class Notifier(Protocol):
    """Cross-replica signals (e.g. PostgreSQL LISTEN/NOTIFY on one connection per
    process). The store sends them in its transactions; this side receives them."""

    async def start(
        self,
        on_events: Callable[[str, int], Awaitable[None] | None],
        on_cancel: Callable[[str], Awaitable[None] | None],
        on_resync: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        """Start delivering ``(session_id, last_sequence)`` of events committed by other
        replicas (``last_sequence`` -1: the session was deleted), and turn ids whose
        cancel was requested (on any replica, this one included).

        ``on_resync`` is called after the notifier reconnected: notifications sent while
        it was disconnected are lost, and it cannot know which sessions they named, so
        the receiver re-reads every session it follows (e.g. ``Hub.resync``).
        """
        ...

    async def stop(self) -> None: ...


# --------------------------------------------------------------------------- model


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
    project's ``credential_ref`` (docs/spec/turn-loop.md step 4)."""

    project_id: str
    credential_ref: str
    model: str
    purpose: Purpose
    system_prompt: str
    messages: Sequence[ModelMessage]
    tools: Sequence[ToolDeclaration]
    request_id: str
    deadlines: ModelDeadlines


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


@dataclass(frozen=True)
class FinishChunk:
    """The end of the answer; ``usage`` None when the provider reported none."""

    reason: FinishReason
    usage: Usage | None


ModelChunk = TextChunk | ToolCallStartChunk | ToolCallChunk | FinishChunk


class ModelGateway(Protocol):
    """The LLM gateway (``ballet.llm.v1``).

    ``stream`` yields chunks and ends after a ``FinishChunk``. It raises ``ModelFailure``
    after its own bounded retries (only before the first delta; docs/spec/turn-loop.md).
    """

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]: ...


# --------------------------------------------------------------------------- backends


class ToolBackends(Protocol):
    """The tracker, skills and knowledge backends, acting for a human: one method per RPC
    the tools and the system prompt use, in the types of ``service/core/backend_types.py``.
    Every call acts as ``acting`` (docs/spec/authority.md) within
    ``timeout_s`` seconds (docs/spec/turn-loop.md, Deadlines).

    ``get_project`` (the project, its ``planner.*`` settings and the human's permissions)
    and ``read_skill`` (SKILL.md in the version the project resolves; docs/spec/turn-loop.md)
    serve the system prompt and raise ``PlannerError``s: ``NotFound``
    (``PROJECT_NOT_FOUND``/``SKILL_NOT_FOUND``: unknown or not readable, so existence does
    not leak), ``Unauthenticated`` (its reason, e.g. ``TOKEN_EXPIRED``, kept) and
    ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``; docs/spec/turn-loop.md step 2).

    The tools' methods raise ``ToolFailure`` with the reason the model sees:
    ``PERMISSION_DENIED``, ``NOT_FOUND``, ``INVALID_ARGUMENTS`` (the backend's explanation,
    or a number its field cannot hold, named), ``STALE_VERSION``, ``CONFLICT``,
    ``BACKEND_UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``CREDENTIAL_EXPIRED``,
    ``BACKEND_ERROR``. ``read_skill_content`` is ``ReadSkill`` for the ``read_skill`` tool.
    """

    async def get_project(
        self, acting: Acting, project_id: str, timeout_s: float
    ) -> ProjectInfo: ...
    async def read_skill(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> SkillDocument: ...
    async def list_items(
        self, acting: Acting, query: backend.ItemQuery, timeout_s: float
    ) -> backend.ItemPage: ...
    async def get_item(
        self, acting: Acting, project_id: str, item_id: str, timeout_s: float
    ) -> backend.Item: ...
    async def list_runnable_tickets(
        self, acting: Acting, query: backend.RunnableQuery, timeout_s: float
    ) -> backend.ItemPage: ...
    async def search_project(
        self, acting: Acting, search: backend.ProjectSearch, timeout_s: float
    ) -> backend.ProjectSearchResult: ...
    async def list_changesets(
        self, acting: Acting, query: backend.ChangesetQuery, timeout_s: float
    ) -> backend.ChangesetPage: ...
    async def propose_changeset(
        self, acting: Acting, proposal: backend.ChangesetProposal, timeout_s: float
    ) -> backend.Changeset: ...
    async def list_skills(
        self, acting: Acting, query: backend.SkillQuery, timeout_s: float
    ) -> backend.SkillPage: ...
    async def read_skill_content(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> backend.SkillContent: ...
    async def search_knowledge(
        self, acting: Acting, search: backend.KnowledgeSearch, timeout_s: float
    ) -> backend.KnowledgeHits: ...
    async def get_knowledge_entry(
        self, acting: Acting, entry_id: str, timeout_s: float
    ) -> backend.KnowledgeEntry: ...
    async def create_knowledge_entry(
        self, acting: Acting, entry: backend.NewKnowledgeEntry, timeout_s: float
    ) -> backend.KnowledgeEntry: ...
    async def update_knowledge_entry(
        self, acting: Acting, change: backend.KnowledgeEntryChange, timeout_s: float
    ) -> backend.KnowledgeEntry: ...


# --------------------------------------------------------------------------- clock


class Clock(Protocol):
    """Wall-clock time for stored timestamps and leases; monotonic for deadlines."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...
