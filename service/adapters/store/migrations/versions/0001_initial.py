"""The initial schema: sessions, messages, session events and turns.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written out in full rather than imported from ``tables.py``: a migration must keep
creating the schema of its day when the tables module moves on. A test migrates empty
PostgreSQL and SQLite databases and compares the result with ``tables.metadata``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _text(name: str, *, default: str | None = "") -> sa.Column[str]:
    return sa.Column(
        name,
        sa.Text(),
        nullable=False,
        server_default=None if default is None else sa.text(f"'{default}'"),
    )


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), nullable=False, server_default=sa.text("0"))


def _flag(name: str) -> sa.Column[bool]:
    return sa.Column(name, sa.Boolean(), nullable=False, server_default=sa.text("false"))


def _time(name: str, *, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _session_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["session_id"],
        ["sessions.session_id"],
        name=f"fk_{table}_session_id_sessions",
        ondelete="CASCADE",
    )


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.Text(), nullable=False),
        _text("project_id", default=None),
        _text("organization_id", default=None),
        _text("owner_id", default=None),
        _text("title"),
        _time("create_time"),
        _time("update_time"),
        _text("summary"),
        _count("summary_up_to"),
        _count("last_sequence"),
        sa.Column("context_base_tokens", sa.BigInteger(), nullable=True),
        _count("context_pending_bytes"),
        _text("create_request_id"),
        _text("create_request_hash"),
        sa.PrimaryKeyConstraint("session_id", name="pk_sessions"),
    )
    op.create_index(
        "uq_sessions_owner_id_create_request_id",
        "sessions",
        ["owner_id", "create_request_id"],
        unique=True,
        postgresql_where=sa.text("create_request_id <> ''"),
        sqlite_where=sa.text("create_request_id <> ''"),
    )
    op.create_index(
        "ix_sessions_project_id_create_time_session_id",
        "sessions",
        ["project_id", sa.text("create_time DESC"), sa.text("session_id DESC")],
    )

    op.create_table(
        "messages",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("sequence", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("message_id", sa.Text(), nullable=False),
        _text("turn_id", default=None),
        _text("kind", default=None),
        _time("create_time"),
        _text("text"),
        _flag("cut"),
        _text("tool_call_id"),
        _text("tool_name"),
        _text("tool_arguments"),
        _text("tool_result"),
        _flag("tool_error"),
        _text("human_id"),
        sa.Column("usage_input_tokens", sa.BigInteger(), nullable=True),
        sa.Column("usage_output_tokens", sa.BigInteger(), nullable=True),
        _count("up_to"),
        _count("estimated_tokens"),
        _count("size_bytes"),
        _session_fk("messages"),
        sa.PrimaryKeyConstraint("session_id", "sequence", name="pk_messages"),
        sa.UniqueConstraint("message_id", name="uq_messages_message_id"),
    )
    op.create_index("ix_messages_turn_id_sequence", "messages", ["turn_id", "sequence"])

    op.create_table(
        "session_events",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("sequence", sa.BigInteger(), autoincrement=False, nullable=False),
        _text("turn_id", default=None),
        _text("kind", default=None),
        _time("create_time"),
        sa.Column("data", sa.Text(), nullable=True),
        _session_fk("session_events"),
        sa.PrimaryKeyConstraint("session_id", "sequence", name="pk_session_events"),
    )

    op.create_table(
        "turns",
        sa.Column("turn_id", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        _text("human_id", default=None),
        _text("project_id", default=None),
        _text("state", default=None),
        _time("start_time"),
        _time("end_time", nullable=True),
        _count("human_sequence"),
        _text("request_id"),
        _text("request_hash"),
        sa.Column("end_reason", sa.Text(), nullable=True),
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
        _text("owner"),
        _time("lease_expires_at", nullable=True),
        _flag("cancel_requested"),
        sa.CheckConstraint("state IN ('running', 'ended')", name="ck_turns_state"),
        _session_fk("turns"),
        sa.PrimaryKeyConstraint("turn_id", name="pk_turns"),
        sa.UniqueConstraint("session_id", "request_id", name="uq_turns_session_id_request_id"),
    )
    running = sa.text("state = 'running'")
    op.create_index(
        "uq_turns_one_running",
        "turns",
        ["session_id"],
        unique=True,
        postgresql_where=running,
        sqlite_where=running,
    )
    op.create_index("ix_turns_state_lease_expires_at", "turns", ["state", "lease_expires_at"])
    for column in ("owner", "human_id", "project_id"):
        op.create_index(
            f"ix_turns_running_{column}",
            "turns",
            [column],
            postgresql_where=running,
            sqlite_where=running,
        )


def downgrade() -> None:
    op.drop_table("turns")
    op.drop_table("session_events")
    op.drop_table("messages")
    op.drop_table("sessions")
