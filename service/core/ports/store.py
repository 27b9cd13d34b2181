"""Storage port: sessions, transcripts, turns and their events, as one unit of work per
method (``service/adapters/store/`` implements it on SQLAlchemy)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Protocol

from service.core.model import (
    ContextEstimate,
    Message,
    OnBusy,
    Session,
    SessionEvent,
    Turn,
    TurnEndReason,
    Usage,
)


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
class Enqueue:
    """What ``start_turn`` does when a turn of the session runs (decision 0300):
    ``on_busy`` ENQUEUE, INTERRUPT or JOIN stores the message as a QUEUED turn (at most
    ``max_queued`` per session, else ``ResourceExhausted``/``QUEUE_FULL``), with
    ``token`` (the human's, kept until the turn starts) and ``event`` (its
    ``message_queued``, whose ``behind_turn_id`` the store fills in). INTERRUPT also
    flags the running turn cancelled, as ``request_cancel`` does, in the same
    transaction; its queued turn runs before the ENQUEUE ones."""

    on_busy: OnBusy
    max_queued: int
    token: str
    event: SessionEvent


@dataclass(frozen=True)
class TurnStart:
    """Step 1 of the turn loop: the human message and the turn row, in one transaction.

    ``message`` is the human message (sequence 0: the store numbers it) and ``events``
    are ``message_accepted`` and ``turn_started`` (the first carries ``message``).
    ``turn`` is the new running turn with its owner and lease. ``enqueue``, when set,
    says what to do when a turn runs (None: refuse, ``TURN_IN_PROGRESS``).
    """

    turn: Turn
    project_id: str
    message: Message
    events: Sequence[SessionEvent]
    limits: RunningLimits
    now: datetime
    enqueue: Enqueue | None = None


class StartOutcomeKind(StrEnum):
    """What ``start_turn`` did."""

    STARTED = "started"
    #: The (session, request_id) pair was seen before with the same payload.
    DUPLICATE = "duplicate"
    #: A running turn's lease has expired: close it INTERRUPTED, then try again.
    EXPIRED_TURN = "expired_turn"
    #: A turn runs: the message was stored as a QUEUED turn (``TurnStart.enqueue``).
    QUEUED = "queued"


@dataclass(frozen=True)
class TurnStartOutcome:
    """The result of ``start_turn``.

    STARTED: ``turn`` is the new turn, ``events`` the stored events, numbered.
    DUPLICATE: ``turn`` is the original turn, ``events`` holds its stored
    ``message_accepted`` event (``message_queued`` while it is queued). EXPIRED_TURN:
    ``turn`` is the expired running turn. QUEUED: ``turn`` is the queued turn,
    ``events`` its stored ``message_queued``; ``interrupted`` the running turn an
    INTERRUPT flagged cancelled.
    """

    kind: StartOutcomeKind
    turn: Turn
    events: Sequence[SessionEvent] = ()
    interrupted: Turn | None = None
    #: The running turn a JOIN message waits to join (its ``join_pending`` set).
    join_into: Turn | None = None


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
class Promotion:
    """With a turn's ending, start the session's first queued turn (decision 0300):
    RUNNING, owned by ``owner`` (the ending replica) until ``lease_expires_at``, its
    ``turn_started`` event carrying ``model`` and ``max_rounds``."""

    owner: str
    lease_expires_at: datetime
    model: str
    max_rounds: int


@dataclass(frozen=True)
class Promoted:
    """A queued turn the ending started: ``turn`` as it runs now, its stored
    ``message_accepted`` and ``turn_started`` (``events``), and the human's ``token``."""

    turn: Turn
    events: list[SessionEvent]
    token: str


@dataclass(frozen=True)
class TurnEnd:
    """What ``end_turn`` stored: the ending's ``events``, numbered, and the queued turn
    it started, if any."""

    events: list[SessionEvent]
    promoted: Promoted | None = None


@dataclass(frozen=True)
class LeaseStatus:
    """The result of a lease renewal: ``held`` false means another replica took over."""

    held: bool
    cancel_requested: bool = False
    #: With ``cancel_requested``: "" (CancelTurn) or "interrupted_by_message".
    cancel_reason: str = ""
    #: A JOIN message waits to join the turn's next model request (decision 0303).
    join_pending: bool = False


@dataclass(frozen=True)
class ContextSnapshot:
    """What the model will see: the session (summary, estimate) and the messages after
    the summary's ``up_to``, in sequence order (docs/spec/compaction.md)."""

    session: Session
    messages: Sequence[Message]


class SessionStore(Protocol):
    """Sessions, transcripts, turns and events (docs/spec/storage.md).

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

    def kept_context(self, session_id: str) -> ContextSnapshot | None:
        """What ``load_context`` would answer now from memory, when this process holds
        the session's context provably current; else None. Never reads the database and
        never waits (the early model call, decision 0380)."""
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

    async def end_turn(self, commit: TurnCommit, promotion: Promotion) -> TurnEnd:
        """Apply ``commit`` (a ``turn_patch`` with an ``end_reason``), and in the same
        transaction start the session's first queued turn with ``promotion``: INTERRUPT
        ones first, then in acceptance order; its human message is stored now, numbered
        after the ending (decision 0300). Raises as ``commit``."""
        ...

    async def join_queued(
        self, session_id: str, turn_id: str, owner: str, now: datetime
    ) -> list[SessionEvent]:
        """Take the session's queued JOIN messages into running turn ``turn_id`` (owned
        by ``owner``), in acceptance order, in one transaction (decision 0303): each
        message is stored now as a human message of ``turn_id`` with its
        ``message_accepted``, and its queued turn ends ``JOINED`` with a ``turn_ended``;
        the turn's ``join_pending`` is cleared. Returns the events, numbered ([] when
        none waited); ``StoreConflict`` when the turn is not ``owner``'s running turn."""
        ...

    async def cancel_queued(self, turn_id: str, event: SessionEvent) -> list[SessionEvent]:
        """End a QUEUED turn CANCELLED without running it, storing ``event`` (its
        ``turn_ended``); returns it numbered, or [] when the turn is not queued (it
        started or ended meanwhile)."""
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
