"""Joined messages: a queued turn remembers its strategy, a running turn that a JOIN
waits for (decision 0303).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

``turns.on_busy`` is the strategy a queued turn's message was sent with (``enqueue``,
``interrupt``, ``join``; empty for a turn that started at once). ``turns.join_pending``
is set on the running turn when a JOIN message is queued behind it, in the same
transaction, and cleared when the running turn takes the message into its next model
request; the owner learns of it through the cancel signal or its next lease renewal.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("on_busy", sa.Text(), nullable=False, server_default=""))
        batch.add_column(
            sa.Column("join_pending", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("join_pending")
        batch.drop_column("on_busy")
