"""The planner's SQL schema as SQLAlchemy Core tables (docs/spec/api-and-streams.md,
docs/spec/turn-loop.md and docs/spec/storage.md).

Seven tables, all keyed by text ids the planner generates:

- ``sessions``: one row per session, with the compaction summary, the per-session event
  counter ``last_sequence`` (docs/spec/api-and-streams.md: from 1, no gaps, no reuse), the running
  context estimate (docs/spec/compaction.md) and the AIP-155 key of the ``CreateSession`` that made
  it.
- ``messages``: the transcript, keyed by (session, sequence); ``size_bytes`` is
  ``Message.size_bytes()`` so a page of ``ListMessages`` is sized without re-encoding
  text.
- ``session_events``: every stored session event, keyed by (session, sequence). Message
  events keep their text only in ``messages`` (joined on the same key when read);
  ``data`` holds the JSON of the event's ``EventData`` payload, NULL when it has none.
- ``turns``: one row per turn, with its AIP-155 request id, the replica that owns it and
  its lease (docs/spec/turn-loop.md, "Ownership and recovery").
- ``planner_replicas`` and ``chat_streams``: each replica's heartbeat lease and the Chat
  streams open on it, for the per-human stream limit across replicas (docs/spec/limits.md).
- ``session_follows``: the sessions each replica follows, so that a commit signals other
  replicas only when one follows its session (decision 0340).

Unique keys carry the concurrency rules: the partial index ``uq_turns_one_running`` (one
running turn per session, across replicas) and the AIP-155 request-id keys (for
sessions a partial index that ignores the empty id, since creating a session through
Chat ``open`` may carry none). Deleting a session cascades to its messages, events and
turns, and so to its idempotency keys (docs/spec/api-and-streams.md, ``DeleteSession``).

Timestamps are timezone-aware UTC in Python on both dialects (``UtcDateTime``).
Migrations (``migrations/versions``) create exactly this schema; a test compares them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    literal_column,
    text,
)
from sqlalchemy.types import TypeDecorator

#: Constraint and index names are derived, so migrations and reflection agree on them
#: and a violated constraint can be recognised by name (``repository._translated``).
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: ``turns.state`` values (``service.core.model.TurnState``).
RUNNING = "running"
ENDED = "ended"
QUEUED = "queued"


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every dialect.

    PostgreSQL stores ``timestamp with time zone``; SQLite has no time zone type, so the
    value is stored as naive UTC in SQLAlchemy's fixed-width text form, which also sorts
    correctly. Results are always aware UTC. Naive datetimes are refused (``ValueError``):
    guessing their zone would silently shift leases.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store needs aware UTC times")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime from the database, got {value!r}")
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _text(name: str, *, nullable: bool = False, default: str | None = "") -> Column[str]:
    # Text columns default to '' rather than NULL: the domain types use '' for "none",
    # and one spelling of "none" keeps comparisons and unique keys simple.
    return Column(
        name,
        Text,
        nullable=nullable,
        server_default=None if default is None else text(f"'{default}'"),
    )


def _count(name: str) -> Column[int]:
    return Column(name, BigInteger, nullable=False, server_default=text("0"))


def _flag(name: str) -> Column[bool]:
    return Column(name, Boolean, nullable=False, server_default=text("false"))


sessions = Table(
    "sessions",
    metadata,
    Column("session_id", Text, primary_key=True),
    _text("project_id", default=None),
    _text("organization_id", default=None),
    _text("owner_id", default=None),
    _text("title"),
    Column("create_time", UtcDateTime, nullable=False),
    Column("update_time", UtcDateTime, nullable=False),
    _text("summary"),
    _count("summary_up_to"),
    # The per-session event counter: the last sequence assigned (docs/spec/api-and-streams.md).
    _count("last_sequence"),
    # The context estimate (docs/spec/compaction.md): reported usage, NULL when none is known yet,
    # and the estimated tokens of what was stored since (decision 0171).
    Column("context_base_tokens", BigInteger, nullable=True),
    _count("context_pending_tokens"),
    _text("create_request_id"),
    _text("create_request_hash"),
)

#: ``create_request_id <> ''``, inlined for the partial index (see ``IS_RUNNING``).
HAS_CREATE_REQUEST_ID = sessions.c.create_request_id != literal_column("''")

# AIP-155 keys of CreateSession, per human; '' means the caller sent none.
Index(
    "uq_sessions_owner_id_create_request_id",
    sessions.c.owner_id,
    sessions.c.create_request_id,
    unique=True,
    postgresql_where=HAS_CREATE_REQUEST_ID,
    sqlite_where=HAS_CREATE_REQUEST_ID,
)
# ListSessions: a project's sessions, newest first, ties by id (docs/spec/api-and-streams.md),
# keyset-paged.
Index(
    "ix_sessions_project_id_create_time_session_id",
    sessions.c.project_id,
    sessions.c.create_time.desc(),
    sessions.c.session_id.desc(),
)
# Retention (migration 0006; docs/decisions/0250-retention-activity-and-batches.md):
# the idle pass walks sessions unchanged since before its cutoff in (update_time, id)
# order, and an erasure finds one human's sessions. ``update_time`` changes only with
# the title or the summary, so this index costs the turn's commits nothing.
Index("ix_sessions_update_time_session_id", sessions.c.update_time, sessions.c.session_id)
Index("ix_sessions_owner_id_session_id", sessions.c.owner_id, sessions.c.session_id)

messages = Table(
    "messages",
    metadata,
    Column(
        "session_id",
        Text,
        ForeignKey(sessions.c.session_id, ondelete="CASCADE"),
        primary_key=True,
    ),
    # The sequence of the session event that stored the message (docs/spec/api-and-streams.md).
    Column("sequence", BigInteger, primary_key=True, autoincrement=False),
    Column("message_id", Text, nullable=False, unique=True),
    _text("turn_id", default=None),
    _text("kind", default=None),
    Column("create_time", UtcDateTime, nullable=False),
    _text("text"),
    _flag("cut"),
    _text("tool_call_id"),
    _text("tool_name"),
    _text("tool_arguments"),
    _text("tool_result"),
    _flag("tool_error"),
    _text("human_id"),
    # NULL when the provider reported no usage (both or neither).
    Column("usage_input_tokens", BigInteger, nullable=True),
    Column("usage_output_tokens", BigInteger, nullable=True),
    _count("up_to"),
    _count("estimated_tokens"),
    # Message.size_bytes(): what the model sees of it, in UTF-8 bytes (docs/spec/compaction.md).
    _count("size_bytes"),
    # Added by migration 0003 (hence after the others): why an answer did not end
    # normally, and the id the provider gave a tool call (tool_call_id is the planner's).
    _text("finish_reason"),
    _text("provider_call_id"),
    # Added by migration 0010: the model the server said answered, and a summary's
    # prompt version (on its compaction marker); NULL read as ''.
    Column("served_model", Text, nullable=True),
    Column("prompt_version", Text, nullable=True),
)
Index("ix_messages_turn_id_sequence", messages.c.turn_id, messages.c.sequence)

session_events = Table(
    "session_events",
    metadata,
    Column(
        "session_id",
        Text,
        ForeignKey(sessions.c.session_id, ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("sequence", BigInteger, primary_key=True, autoincrement=False),
    _text("turn_id", default=None),
    _text("kind", default=None),
    Column("create_time", UtcDateTime, nullable=False),
    # JSON of the EventData payload; NULL when the event has none.
    Column("data", Text, nullable=True),
)

turns = Table(
    "turns",
    metadata,
    Column("turn_id", Text, primary_key=True),
    Column(
        "session_id",
        Text,
        ForeignKey(sessions.c.session_id, ondelete="CASCADE"),
        nullable=False,
    ),
    _text("human_id", default=None),
    _text("project_id", default=None),
    _text("state", default=None),
    Column("start_time", UtcDateTime, nullable=False),
    Column("end_time", UtcDateTime, nullable=True),
    # The sequence of the human message that started the turn.
    _count("human_sequence"),
    _text("request_id"),
    _text("request_hash"),
    Column("end_reason", Text, nullable=True),
    _text("error_reason"),
    _text("error_message"),
    _count("rounds"),
    _count("usage_input_tokens"),
    _count("usage_output_tokens"),
    _count("compaction_input_tokens"),
    _count("compaction_output_tokens"),
    _count("writes"),
    _text("instructions_version"),
    _text("tool_schema_version"),
    _text("skill_name"),
    _text("skill_version"),
    _text("model"),
    # The replica running the turn and until when its lease holds (docs/spec/turn-loop.md).
    _text("owner"),
    Column("lease_expires_at", UtcDateTime, nullable=True),
    _flag("cancel_requested"),
    # A queued turn (decision 0300): the turn it waited behind; until it starts, its
    # human message (the ``messages`` row as JSON, without session and sequence) and its
    # estimated tokens, and the human's token (never kept longer); its place (INTERRUPT
    # first, then acceptance order: human_sequence is its message_queued event's).
    _text("behind_turn_id"),
    # Why a cancel was requested: '' (CancelTurn) or 'interrupted_by_message' (decision 0301).
    _text("cancel_reason"),
    Column("queued_message", Text, nullable=True),
    Column("queued_token", Text, nullable=True),
    _count("queued_tokens"),
    _count("queue_priority"),
    # Added by migration 0010 (decision 0303): a queued turn's strategy, and on a running
    # turn whether a JOIN message waits to join its next model request.
    _text("on_busy"),
    _flag("join_pending"),
    CheckConstraint(f"state IN ('{RUNNING}', '{ENDED}', '{QUEUED}')", name="state"),
    # AIP-155 keys of SendMessage, per session, for the life of the session
    # (docs/spec/api-and-streams.md). Turns always have one (the request id is required), so the key
    # is not partial and also serves every lookup of a session's turns, e.g. the cascade of a
    # delete.
    UniqueConstraint("session_id", "request_id"),
)

#: ``turns.state = 'running'`` with the value inlined rather than bound: PostgreSQL uses
#: a partial index only when the query's condition implies the index's, which a bound
#: parameter does not once the statement is prepared with a generic plan.
IS_RUNNING = turns.c.state == literal_column(f"'{RUNNING}'")
#: ``turns.state = 'queued'``, inlined for the partial index as ``IS_RUNNING`` is.
IS_QUEUED = turns.c.state == literal_column(f"'{QUEUED}'")

# One running turn per session, across replicas (docs/spec/api-and-streams.md and
# docs/spec/turn-loop.md): the loser of a race between two replicas fails here even if both passed
# the check.
Index(
    "uq_turns_one_running",
    turns.c.session_id,
    unique=True,
    postgresql_where=IS_RUNNING,
    sqlite_where=IS_RUNNING,
)
# A session's queue, in the order its turns run (decision 0300).
Index(
    "ix_turns_queued_session_id",
    turns.c.session_id,
    turns.c.queue_priority,
    turns.c.human_sequence,
    postgresql_where=IS_QUEUED,
    sqlite_where=IS_QUEUED,
)
# The sweeper: running turns whose lease expired (docs/spec/turn-loop.md).
Index("ix_turns_state_lease_expires_at", turns.c.state, turns.c.lease_expires_at)
# Start-up recovery of a replica's own turns, and the running-turn limits (docs/spec/limits.md).
for _column in (turns.c.owner, turns.c.human_id, turns.c.project_id):
    Index(
        f"ix_turns_running_{_column.name}",
        _column,
        postgresql_where=IS_RUNNING,
        sqlite_where=IS_RUNNING,
    )

# The cross-replica count of open Chat streams (docs/spec/limits.md: at most 16 per human;
# docs/decisions/0080-cross-replica-stream-count.md). A replica's heartbeat keeps its
# lease; its streams count only while the lease holds, and forgetting a replica whose
# lease lapsed (a SIGKILL) cascades to its streams.
planner_replicas = Table(
    "planner_replicas",
    metadata,
    Column("replica_id", Text, primary_key=True),
    Column("lease_expires_at", UtcDateTime, nullable=False),
)

# The sessions each replica follows (a Chat stream of the session is attached there),
# written by the replica's notifier as it listens and stops listening (decision 0340). A
# commit reads the other replicas' rows of its session in its own round trip and signals
# only when there is one; forgetting a replica deletes its rows in the same transaction.
# No foreign keys: a row is a hint that may briefly outlive its session or precede its
# replica's first heartbeat, and the heal by sequence covers either.
session_follows = Table(
    "session_follows",
    metadata,
    Column("session_id", Text, primary_key=True),
    Column("replica_id", Text, primary_key=True),
)
Index("ix_session_follows_replica_id", session_follows.c.replica_id)

chat_streams = Table(
    "chat_streams",
    metadata,
    Column("stream_id", Text, primary_key=True),
    _text("human_id", default=None),
    Column(
        "replica_id",
        Text,
        ForeignKey(planner_replicas.c.replica_id, ondelete="CASCADE"),
        nullable=False,
    ),
    Column("opened_at", UtcDateTime, nullable=False),
)
# The count per human, and the cascade from a forgotten replica.
Index("ix_chat_streams_human_id", chat_streams.c.human_id)
Index("ix_chat_streams_replica_id", chat_streams.c.replica_id)

#: Unique constraints and indexes whose violation the repository handles itself.
UQ_ONE_RUNNING_TURN = "uq_turns_one_running"
UQ_TURN_REQUEST_ID = "uq_turns_session_id_request_id"
UQ_SESSION_REQUEST_ID = "uq_sessions_owner_id_create_request_id"
