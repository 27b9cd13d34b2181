"""PostgreSQL: the turn's units of work as server-side functions (one round trip each).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Decision 0113: on PostgreSQL the store's hot path (opening a turn, committing a turn's
events, opening a Chat stream) calls one function per unit of work, so each is one
statement and one round trip instead of four to six. The functions do what the
SQLAlchemy repository does on SQLite, in the same order and with the same locks (the
session row first, then the turn row), and take their arguments as one ``jsonb`` object
whose rows use the tables' own column names (``jsonb_populate_record``). A failed
condition raises SQLSTATE ``BP409``, which rolls the statement back and which the store
translates into ``StoreConflict``. SQLite has no server-side functions: nothing here runs
there.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The columns a commit may set on its turn (TurnPatch); absent keys keep the row's value.
_PATCHED_BIGINT = (
    "rounds",
    "usage_input_tokens",
    "usage_output_tokens",
    "compaction_input_tokens",
    "compaction_output_tokens",
    "writes",
)
_PATCHED_TEXT = (
    "instructions_version",
    "tool_schema_version",
    "skill_name",
    "skill_version",
    "model",
    "end_reason",
    "error_reason",
    "error_message",
    "state",
)


def _patch_assignments() -> str:
    lines = [f"{c} = COALESCE((v_patch->>'{c}')::bigint, {c})" for c in _PATCHED_BIGINT]
    lines += [f"{c} = COALESCE(v_patch->>'{c}', {c})" for c in _PATCHED_TEXT]
    lines.append("end_time = COALESCE((v_patch->>'end_time')::timestamptz, end_time)")
    return ",\n            ".join(lines)


# Inserts the messages and the events of a unit of work numbered up to v_last: p->'events'
# is the ordered list of events ({"kind", "create_time", "data"}), p->'messages' the
# messages rows, each with "i", the index of the event that stores it.
_INSERT_EVENTS = """
    INSERT INTO messages
    SELECT r.*
    FROM jsonb_array_elements(p->'messages') AS m(value),
         LATERAL jsonb_populate_record(
             NULL::messages,
             m.value || jsonb_build_object(
                 'session_id', v_session,
                 'sequence', v_last - v_count + 1 + (m.value->>'i')::int)
         ) AS r;
    INSERT INTO session_events (session_id, sequence, turn_id, kind, create_time, data)
    SELECT v_session, v_last - v_count + e.n, v_turn, e.value->>'kind',
           (e.value->>'create_time')::timestamptz, e.value->>'data'
    FROM jsonb_array_elements(p->'events') WITH ORDINALITY AS e(value, n);
    IF p->>'notify' IS NOT NULL AND v_count > 0 THEN
        PERFORM pg_notify(
            'ballet_planner_events', v_session || ' ' || v_last || ' ' || (p->>'notify'));
    END IF;
"""

_COMMIT = f"""
CREATE OR REPLACE FUNCTION planner_commit(p jsonb) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    v_session text := p->>'session_id';
    v_turn text := p->>'turn_id';
    v_now timestamptz := (p->>'now')::timestamptz;
    v_count int := jsonb_array_length(p->'events');
    v_patch jsonb := COALESCE(p->'patch', '{{}}'::jsonb);
    v_context jsonb := NULLIF(p->'context', 'null'::jsonb);
    v_last bigint;
BEGIN
    -- The session row first (the lock order of every unit of work), numbering the events.
    UPDATE sessions SET
        last_sequence = last_sequence + v_count,
        context_base_tokens = CASE WHEN v_context IS NULL THEN context_base_tokens
                                   ELSE (v_context->>'base_tokens')::bigint END,
        context_pending_tokens = CASE WHEN v_context IS NULL
                                     THEN context_pending_tokens + (p->>'added_tokens')::bigint
                                     ELSE (v_context->>'pending_tokens')::bigint END,
        summary = COALESCE(p->>'summary', summary),
        summary_up_to = COALESCE((p->>'summary_up_to')::bigint, summary_up_to),
        update_time = CASE WHEN p->>'summary' IS NULL THEN update_time ELSE v_now END
    WHERE session_id = v_session
    RETURNING last_sequence INTO v_last;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session % is gone', v_session USING ERRCODE = 'BP409';
    END IF;
    UPDATE turns SET
            {_patch_assignments()}
    WHERE turn_id = v_turn AND session_id = v_session AND state = 'running'
      AND (p->>'owner' IS NULL OR owner = p->>'owner')
      AND (p->>'lease_expired_before' IS NULL OR lease_expires_at IS NULL
           OR lease_expires_at < (p->>'lease_expired_before')::timestamptz);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'turn % is not running under the commit''s conditions', v_turn
            USING ERRCODE = 'BP409';
    END IF;
    {_INSERT_EVENTS}
    RETURN v_last;
END
$fn$;
"""

_START_TURN = f"""
CREATE OR REPLACE FUNCTION planner_start_turn(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $fn$
DECLARE
    v_turn_row jsonb := p->'turn';
    v_session text := v_turn_row->>'session_id';
    v_turn text := v_turn_row->>'turn_id';
    v_now timestamptz := (p->>'now')::timestamptz;
    v_count int := jsonb_array_length(p->'events');
    v_previous bigint;
    v_last bigint;
    v_found turns%ROWTYPE;
    v_event jsonb;
    v_running int;
BEGIN
    SELECT last_sequence INTO v_previous FROM sessions WHERE session_id = v_session FOR UPDATE;
    IF NOT FOUND THEN
        RETURN jsonb_build_object('outcome', 'not_found');
    END IF;
    -- AIP-155 first (the duplicate check runs before the one-running-turn check).
    SELECT * INTO v_found FROM turns
    WHERE session_id = v_session AND request_id = v_turn_row->>'request_id';
    IF FOUND THEN
        IF v_found.request_hash <> v_turn_row->>'request_hash' THEN
            RETURN jsonb_build_object('outcome', 'reused');
        END IF;
        SELECT to_jsonb(e) || jsonb_build_object('message', to_jsonb(m)) INTO v_event
        FROM session_events e
        LEFT JOIN messages m ON m.session_id = e.session_id AND m.sequence = e.sequence
        WHERE e.session_id = v_session AND e.sequence = v_found.human_sequence;
        RETURN jsonb_build_object(
            'outcome', 'duplicate', 'turn', to_jsonb(v_found), 'event', v_event);
    END IF;
    SELECT * INTO v_found FROM turns WHERE session_id = v_session AND state = 'running';
    IF FOUND THEN
        IF v_found.lease_expires_at > v_now THEN
            RETURN jsonb_build_object('outcome', 'in_progress');
        END IF;
        RETURN jsonb_build_object('outcome', 'expired', 'turn', to_jsonb(v_found));
    END IF;
    SELECT count(*) INTO v_running FROM turns
    WHERE state = 'running' AND human_id = v_turn_row->>'human_id' AND lease_expires_at > v_now;
    IF v_running >= (p->>'per_human')::int THEN
        RETURN jsonb_build_object('outcome', 'too_many', 'scope', 'human');
    END IF;
    SELECT count(*) INTO v_running FROM turns
    WHERE state = 'running' AND project_id = v_turn_row->>'project_id'
      AND lease_expires_at > v_now;
    IF v_running >= (p->>'per_project')::int THEN
        RETURN jsonb_build_object('outcome', 'too_many', 'scope', 'project');
    END IF;
    UPDATE sessions SET
        last_sequence = last_sequence + v_count,
        context_pending_tokens = context_pending_tokens + (p->>'added_tokens')::bigint
    WHERE session_id = v_session
    RETURNING last_sequence INTO v_last;
    INSERT INTO turns SELECT r.* FROM jsonb_populate_record(
        NULL::turns,
        v_turn_row || jsonb_build_object(
            'human_sequence', v_last - v_count + 1 + (p->>'human_index')::int)
    ) AS r;
    {_INSERT_EVENTS}
    RETURN jsonb_build_object('outcome', 'started', 'last_sequence', v_last,
                              'previous_sequence', v_previous);
END
$fn$;
"""

_OPEN_STREAM = """
CREATE OR REPLACE FUNCTION planner_open_stream(p jsonb) RETURNS boolean
LANGUAGE plpgsql AS $fn$
DECLARE
    v_count int;
BEGIN
    -- One human's admissions queue here, on every replica (decision 0080).
    PERFORM pg_advisory_xact_lock(
        hashtextextended('ballet_planner.chat_streams:' || (p->>'human_id'), 0));
    SELECT count(*) INTO v_count
    FROM chat_streams s JOIN planner_replicas r ON r.replica_id = s.replica_id
    WHERE s.human_id = p->>'human_id' AND r.lease_expires_at > (p->>'now')::timestamptz;
    IF v_count >= (p->>'limit')::int THEN
        RETURN false;
    END IF;
    INSERT INTO chat_streams (stream_id, human_id, replica_id, opened_at)
    VALUES (p->>'stream_id', p->>'human_id', p->>'replica_id',
            (p->>'opened_at')::timestamptz);
    RETURN true;
END
$fn$;
"""

_FUNCTIONS = ("planner_commit", "planner_start_turn", "planner_open_stream")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for body in (_COMMIT, _START_TURN, _OPEN_STREAM):
        op.execute(body)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in _FUNCTIONS:
        op.execute(f"DROP FUNCTION IF EXISTS {name}(jsonb)")
