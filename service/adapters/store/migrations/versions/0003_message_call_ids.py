"""Messages: the provider's id of a tool call beside the planner's, and an answer's
finish reason.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

``tool_call_id`` becomes the planner's own id for a call, unique in the session (results
are paired with calls by it); ``provider_call_id`` keeps the id the provider gave the
call, only to speak to the provider again (decision 0111). ``finish_reason`` says why an
answer did not end normally (``length``, ``content_filter``, ``refusal``, ``truncated``).
Rows stored before have '' in both: their ``tool_call_id`` was the provider's id, which
the planner then sends back as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for name in ("finish_reason", "provider_call_id"):
        op.add_column(
            "messages",
            sa.Column(name, sa.Text(), nullable=False, server_default=sa.text("''")),
        )


def downgrade() -> None:
    for name in ("provider_call_id", "finish_reason"):
        op.drop_column("messages", name)
