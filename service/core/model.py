"""The planner's domain types: sessions, messages, turns, session events and usage.

No I/O and no grpc, protobuf or SQLAlchemy here (docs/contributing.md). Values are frozen
dataclasses; the store and the transport translate them at their edges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeAlias, TypeVar

JsonObject: TypeAlias = dict[str, Any]

_T = TypeVar("_T")


class MessageKind(StrEnum):
    """The kind of a transcript message (docs/spec/api-and-streams.md, "The transcript")."""

    HUMAN = "human"
    ASSISTANT = "assistant"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    COMPACTION = "compaction"


class TurnState(StrEnum):
    """Whether a turn runs, has ended, or waits for the running turn of its session to
    end (QUEUED: a message sent with ``on_busy`` ENQUEUE or INTERRUPT; decision 0300)."""

    RUNNING = "running"
    ENDED = "ended"
    QUEUED = "queued"


class OnBusy(StrEnum):
    """What to do with a human message that arrives while a turn of its session runs
    (docs/clients.md; decision 0300). REJECT is the default."""

    REJECT = "reject"
    ENQUEUE = "enqueue"
    INTERRUPT = "interrupt"
    JOIN = "join"


class TurnEndReason(StrEnum):
    """Why a turn ended (docs/spec/turn-loop.md and docs/spec/api-and-streams.md,
    ``TurnEndReason``)."""

    COMPLETED = "completed"
    MAX_ROUNDS = "max_rounds"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    #: A message sent with ``on_busy`` INTERRUPT stopped the turn (decision 0301).
    INTERRUPTED_BY_MESSAGE = "interrupted_by_message"
    #: A queued JOIN message's turn: its message joined the running turn (decision 0303).
    JOINED = "joined"
    #: An answer stopped at its output cap (decision 0291).
    OUTPUT_LIMIT = "output_limit"
    #: The next model call or tool call would not fit a turn budget (decision 0291).
    BUDGET_EXHAUSTED = "budget_exhausted"


class EventKind(StrEnum):
    """The kinds of stored session event (docs/spec/api-and-streams.md, "Two kinds of server
    event")."""

    MESSAGE_ACCEPTED = "message_accepted"
    TURN_STARTED = "turn_started"
    ASSISTANT_MESSAGE = "assistant_message"
    TOOL_CALL_STARTED = "tool_call_started"
    TOOL_CALL_FINISHED = "tool_call_finished"
    CHANGESET_PROPOSED = "changeset_proposed"
    KNOWLEDGE_WRITTEN = "knowledge_written"
    COMPACTED = "compacted"
    TURN_ENDED = "turn_ended"
    #: A human message stored as a queued turn (its transcript message is stored by the
    #: ``message_accepted`` of the turn's start; decision 0300).
    MESSAGE_QUEUED = "message_queued"


#: Events that store a message; the message's sequence is the event's.
MESSAGE_EVENTS = frozenset(
    {
        EventKind.MESSAGE_ACCEPTED,
        EventKind.ASSISTANT_MESSAGE,
        EventKind.TOOL_CALL_STARTED,
        EventKind.TOOL_CALL_FINISHED,
        EventKind.COMPACTED,
    }
)


@dataclass(frozen=True)
class Usage:
    """Tokens reported by the provider: ``input_tokens`` counts all prompt tokens."""

    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens
        )

    @property
    def total(self) -> int:
        """Input plus output tokens: the context the next call starts from."""
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class Session:
    """One conversation of a human with the planner about one project.

    ``summary``/``summary_up_to`` hold the latest compaction (empty/0 when none);
    ``last_sequence`` is the per-session event counter; ``context`` is the running
    context estimate (docs/spec/compaction.md). ``create_request_id`` is the AIP-155 key of the
    ``CreateSession`` that made it.
    """

    session_id: str
    project_id: str
    organization_id: str
    owner_id: str
    title: str
    create_time: datetime
    update_time: datetime
    summary: str = ""
    summary_up_to: int = 0
    last_sequence: int = 0
    running_turn_id: str = ""
    context: ContextEstimate = field(default_factory=lambda: ContextEstimate())
    create_request_id: str = ""


@dataclass(frozen=True)
class ContextEstimate:
    """The running context estimate of a session, in tokens (docs/spec/compaction.md; decision
    0171).

    ``base_tokens`` is the usage (input + output) reported for the latest turn-purpose
    answer: everything that request sent and the answer, the system prompt and tool
    declarations included. None when no usage is known: a new session, after a
    compaction, or a provider that reports none; the estimate then adds the fixed prompt
    and the summary at their current size. ``pending_tokens`` is the calibrated estimate
    (``service.core.estimate.message_tokens``) of the messages stored after that point
    (after the summary when ``base_tokens`` is None), so the estimate costs O(new
    messages), never O(transcript).
    """

    base_tokens: int | None = None
    pending_tokens: int = 0


@dataclass(frozen=True)
class Message:
    """One transcript message (docs/spec/api-and-streams.md, "The transcript and sessions").

    ``sequence`` is the sequence of the session event that stored it. Tool calls carry
    ``tool_call_id`` (the planner's own id for the call, unique in the session: results
    are paired with calls by it), ``provider_call_id`` (the id the provider gave the
    call, kept only to speak to the provider; providers reuse theirs), ``tool_name`` and
    ``tool_arguments`` (JSON text as the model sent it, possibly invalid); tool results
    carry ``tool_call_id``, ``tool_name``, ``tool_result`` (JSON text) and
    ``tool_error``. Assistant answers carry ``cut`` (a partial answer) and
    ``finish_reason`` (``length``, ``content_filter``, ``refusal`` or ``truncated`` when
    the answer did not end normally; empty otherwise). A tool call's ``cut`` says its
    arguments were over the bound a call may have: they are stored cut (valid JSON,
    ``service.core.tools.cut.cut_text``) and the call was not run (decision 0221).
    ``human_id`` is the human the message came from or the planner acted for. Compaction
    markers carry ``up_to`` and ``estimated_tokens``, and ``prompt_version``, the version
    of the summary instructions that wrote the summary stored with them (decision 0294).
    Assistant answers carry ``served_model``, the model the server said answered
    (decision 0297; '' when it said none).

    ``truncated`` and ``original_bytes`` are never stored: they mark a copy made for a
    client, whose longest field was cut to fit what a client is sent
    (``service.core.client_copy``; ``original_bytes`` is that field's full UTF-8 size).
    """

    session_id: str
    turn_id: str
    message_id: str
    kind: MessageKind
    create_time: datetime
    sequence: int = 0
    text: str = ""
    cut: bool = False
    finish_reason: str = ""
    tool_call_id: str = ""
    provider_call_id: str = ""
    tool_name: str = ""
    tool_arguments: str = ""
    tool_result: str = ""
    tool_error: bool = False
    human_id: str = ""
    usage: Usage | None = None
    up_to: int = 0
    estimated_tokens: int = 0
    truncated: bool = False
    original_bytes: int = 0
    served_model: str = ""
    prompt_version: str = ""

    def size_bytes(self) -> int:
        """The UTF-8 size of what the model sees of this message, for the estimate and
        the bounds of what is queued and sent; computed once per message object (a
        numbered copy keeps it: its fields are the same)."""
        size = self.__dict__.get("_size_bytes")
        if size is None:
            size = (
                len(self.text.encode())
                + len(self.tool_name.encode())
                + len(self.tool_arguments.encode())
                + len(self.tool_result.encode())
            )
            # Not a field: equality, repr and the store never see it.
            object.__setattr__(self, "_size_bytes", size)
        return size


@dataclass(frozen=True)
class TurnStartedData:
    """Payload of ``turn_started``."""

    model: str
    max_rounds: int


@dataclass(frozen=True)
class MessageQueuedData:
    """Payload of ``message_queued``: the queued message's ``text``, the turn it waits
    behind and the strategy it was sent with."""

    text: str
    behind_turn_id: str
    on_busy: OnBusy
    human_id: str


@dataclass(frozen=True)
class TurnEndedData:
    """Payload of ``turn_ended``; ``error_reason`` is an ErrorInfo reason for FAILED."""

    reason: TurnEndReason
    usage: Usage
    compaction_usage: Usage
    rounds: int
    error_reason: str = ""
    error_message: str = ""


@dataclass(frozen=True)
class ChangesetProposedData:
    """Payload of ``changeset_proposed``."""

    changeset_id: str
    tool_call_id: str


@dataclass(frozen=True)
class KnowledgeWrittenData:
    """Payload of ``knowledge_written``."""

    entry_id: str
    version: int
    tool_call_id: str


@dataclass(frozen=True)
class CompactedData:
    """Payload of ``compacted`` (the ``planner.compacted`` event of docs/spec/compaction.md)."""

    up_to: int
    estimated_tokens: int


EventData: TypeAlias = (
    TurnStartedData
    | TurnEndedData
    | ChangesetProposedData
    | KnowledgeWrittenData
    | CompactedData
    | MessageQueuedData
)


@dataclass(frozen=True)
class SessionEvent:
    """A stored session event (docs/spec/api-and-streams.md).

    ``sequence`` is 0 until the store assigns it (per session, from 1, no gaps, in the
    transaction that stores the event). Message events carry their ``message``; the
    others carry ``data``. ``request_id`` is the client's request id of a
    ``message_accepted`` as this process published it live (never stored, never read
    back): the sending stream's copy of the event echoes it.
    """

    session_id: str
    turn_id: str
    kind: EventKind
    create_time: datetime
    sequence: int = 0
    message: Message | None = None
    data: EventData | None = None
    request_id: str = field(default="", compare=False)

    def with_sequence(self, sequence: int) -> SessionEvent:
        """Return a copy numbered ``sequence``, its message numbered the same."""
        # Every commit numbers each of its events: a copy of the fields, not
        # dataclasses.replace, which re-runs __init__ over every field (ten times slower).
        if self.message is None:
            return copied(self, sequence=sequence)
        return copied(self, sequence=sequence, message=copied(self.message, sequence=sequence))


def copied(value: _T, **changes: object) -> _T:
    """A copy of the dataclass ``value`` with ``changes`` (field names to values),
    without ``__init__``: ``dataclasses.replace`` for the hot path, about ten times
    faster. Only for dataclasses without ``__slots__`` or ``__post_init__``, whose
    ``changes`` are fields of theirs (not checked)."""
    fields = dict(value.__dict__)
    fields.update(changes)
    copied = object.__new__(type(value))
    object.__setattr__(copied, "__dict__", fields)
    return copied


@dataclass(frozen=True)
class TextDelta:
    """A piece of an answer as it streams: not stored, never replayed
    (docs/spec/api-and-streams.md).

    ``offset`` is the piece's offset in the answer text, in characters; ``message_id``
    the id the assistant message will have.
    """

    session_id: str
    turn_id: str
    message_id: str
    offset: int
    text: str


@dataclass(frozen=True)
class ToolCallProgress:
    """A tool call the model began writing: its name is known, its arguments may still
    be streaming. Not stored, never replayed (like ``TextDelta``); ``tool_call_id`` is the
    planner's id the call will be stored under, ``index`` its position in the answer."""

    session_id: str
    turn_id: str
    tool_call_id: str
    tool_name: str
    index: int


@dataclass(frozen=True)
class Turn:
    """One turn (docs/spec/api-and-streams.md, ``GetTurn``; docs/spec/turn-loop.md, ownership across
    replicas).

    ``owner``/``lease_expires_at`` name the replica running it and until when its lease
    holds; ``cancel_requested`` is set by a cancel from any replica.
    """

    turn_id: str
    session_id: str
    human_id: str
    state: TurnState
    start_time: datetime
    human_sequence: int = 0
    request_id: str = ""
    request_hash: str = ""
    end_reason: TurnEndReason | None = None
    error_reason: str = ""
    error_message: str = ""
    rounds: int = 0
    usage: Usage = Usage()
    compaction_usage: Usage = Usage()
    writes: int = 0
    instructions_version: str = ""
    tool_schema_version: str = ""
    skill_name: str = ""
    skill_version: str = ""
    model: str = ""
    owner: str = ""
    lease_expires_at: datetime | None = None
    cancel_requested: bool = False
    end_time: datetime | None = None
    #: A queued turn's place: the turn it waited behind when accepted, and its text
    #: until it starts (decision 0300).
    behind_turn_id: str = ""
    queued_text: str = ""
    #: Why a cancel was requested: "" (CancelTurn) or "interrupted_by_message".
    cancel_reason: str = ""
    #: A JOIN message waits to join this running turn's next model request (0303).
    join_pending: bool = False
