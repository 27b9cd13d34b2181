"""Queued turns: a message sent while a turn runs waits as a turn row (decision 0300).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06

``turns.state`` gains ``queued``. A queued turn keeps, until it starts, its human message
(``queued_message``: the ``messages`` row as JSON, without session and sequence), that
message's estimated tokens and the human's token (``queued_token``, erased when the turn
starts or ends), the turn it waited behind, and its place in the queue
(``queue_priority``: INTERRUPT first; then ``human_sequence``, the sequence of its
``message_queued`` event, which is the acceptance order). ``cancel_reason`` says why a
cancel was requested: empty for ``CancelTurn``, ``interrupted_by_message`` for an
INTERRUPT (decision 0301), so the owner, told on any replica, ends the turn with that
reason.

On PostgreSQL, ``planner_end_turn(p)`` is the unit of work that ends a turn: it calls
``planner_commit(p)`` (so every condition and change of that function applies as it is)
and then, in the same transaction, promotes the session's first queued turn to running
with ``p->'promote'``'s owner and lease, storing its ``message_accepted`` (the human
message, numbered where the turn starts) and ``turn_started``. It returns
``{"last": <last sequence>, "promoted": <the turn row before the promotion> | null}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_END_TURN = """
CREATE OR REPLACE FUNCTION planner_end_turn(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $fn$
DECLARE
    v_session text := p->>'session_id';
    v_now timestamptz := (p->>'now')::timestamptz;
    v_promote jsonb := NULLIF(p->'promote', 'null'::jsonb);
    v_last bigint;
    v_next turns%ROWTYPE;
BEGIN
    -- The ending itself, with every condition of a turn's commit (it locks the session
    -- row first, then the turn row).
    v_last := planner_commit(p);
    IF v_promote IS NULL THEN
        RETURN jsonb_build_object('last', v_last, 'promoted', NULL);
    END IF;
    SELECT * INTO v_next FROM turns
    WHERE session_id = v_session AND state = 'queued'
    ORDER BY queue_priority DESC, human_sequence
    LIMIT 1
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN jsonb_build_object('last', v_last, 'promoted', NULL);
    END IF;
    UPDATE sessions SET
        last_sequence = last_sequence + 2,
        context_pending_tokens = context_pending_tokens + v_next.queued_tokens
    WHERE session_id = v_session
    RETURNING last_sequence INTO v_last;
    INSERT INTO messages
    SELECT r.* FROM jsonb_populate_record(
        NULL::messages,
        v_next.queued_message::jsonb || jsonb_build_object(
            'session_id', v_session, 'sequence', v_last - 1)
    ) AS r;
    INSERT INTO session_events (session_id, sequence, turn_id, kind, create_time, data)
    VALUES (v_session, v_last - 1, v_next.turn_id, 'message_accepted', v_now, NULL),
           (v_session, v_last, v_next.turn_id, 'turn_started', v_now,
            v_promote->>'turn_started');
    UPDATE turns SET
        state = 'running',
        start_time = v_now,
        human_sequence = v_last - 1,
        model = v_promote->>'model',
        owner = v_promote->>'owner',
        lease_expires_at = (v_promote->>'lease_expires_at')::timestamptz,
        queued_message = NULL,
        queued_token = NULL
    WHERE turn_id = v_next.turn_id;
    RETURN jsonb_build_object('last', v_last, 'promoted', to_jsonb(v_next));
END
$fn$;
"""


def _replace_state_check(states: str) -> None:
    # The check's name differs between a schema made by these migrations (0001 named it
    # through the naming convention: ck_turns_ck_turns_state) and one made from the
    # tables (ck_turns_state); PostgreSQL drops either. SQLite's batch mode recreates
    # the table without the old check, whichever its name, and with the new one.
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE turns DROP CONSTRAINT IF EXISTS ck_turns_ck_turns_state")
        op.execute("ALTER TABLE turns DROP CONSTRAINT IF EXISTS ck_turns_state")
        op.create_check_constraint(op.f("ck_turns_state"), "turns", f"state IN ({states})")
        return
    checks = sa.inspect(op.get_bind()).get_check_constraints("turns")
    with op.batch_alter_table("turns", recreate="always") as batch:
        for check in checks:
            if check["name"] in ("ck_turns_ck_turns_state", "ck_turns_state"):
                batch.drop_constraint(op.f(check["name"]), type_="check")
        batch.create_check_constraint(op.f("ck_turns_state"), f"state IN ({states})")


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("behind_turn_id", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("cancel_reason", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("queued_message", sa.Text(), nullable=True))
        batch.add_column(sa.Column("queued_token", sa.Text(), nullable=True))
        batch.add_column(
            sa.Column("queued_tokens", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("queue_priority", sa.BigInteger(), nullable=False, server_default="0")
        )
    _replace_state_check("'running', 'ended', 'queued'")
    op.create_index(
        "ix_turns_queued_session_id",
        "turns",
        ["session_id", "queue_priority", "human_sequence"],
        postgresql_where=sa.text("state = 'queued'"),
        sqlite_where=sa.text("state = 'queued'"),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_END_TURN)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS planner_end_turn(jsonb)")
    op.drop_index("ix_turns_queued_session_id", table_name="turns")
    op.execute("DELETE FROM turns WHERE state = 'queued'")
    _replace_state_check("'running', 'ended'")
    with op.batch_alter_table("turns") as batch:
        for column in (
            "queue_priority",
            "queued_tokens",
            "queued_token",
            "queued_message",
            "cancel_reason",
            "behind_turn_id",
        ):
            batch.drop_column(column)
