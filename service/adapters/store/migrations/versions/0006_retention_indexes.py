"""Sessions: the indexes of the retention pass and of erasure.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

The retention pass (``service/core/retention.py``) walks the sessions whose
``update_time`` is before its cutoff, in ``(update_time, session_id)`` order, and an
erasure (``ballet-planner purge --human``) finds one human's sessions by ``owner_id``
(decision 0250). ``update_time`` changes only with a session's title or summary, so the
first index leaves a turn's commits as they were (their UPDATE of ``sessions`` touches
no indexed column and stays a heap-only update on PostgreSQL).

The indexes are built inside the migration's transaction, as every migration here is:
on PostgreSQL writes to ``sessions`` wait for the build (0.9 s per index for a million
sessions, measured).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_sessions_update_time_session_id", "sessions", ["update_time", "session_id"])
    op.create_index("ix_sessions_owner_id_session_id", "sessions", ["owner_id", "session_id"])


def downgrade() -> None:
    op.drop_index("ix_sessions_owner_id_session_id", table_name="sessions")
    op.drop_index("ix_sessions_update_time_session_id", table_name="sessions")
