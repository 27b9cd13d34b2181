"""AIP-155 request ids for the backends' write RPCs (docs/spec/authority.md).

A key is ``(RPC name, human, request_id)`` and remembers a digest of the request (without
its ``request_id``) and a reference to what the first request produced. The key row is
inserted in the same transaction as the write, so the write and its key commit together,
and of two concurrent requests with one id the second fails on the primary key and, when
retried, replays the first.

The same id with a different payload is refused with ``INVALID_ARGUMENT`` /
``REQUEST_ID_REUSED``, as the planner's own API does (docs/spec/api-and-streams.md); see
docs/decisions/0104-devstack-idempotent-writes.md. A refused request stores nothing, so
its id may be used again.
"""

from __future__ import annotations

import hashlib
import time

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.errors import InvalidArgument
from devstack.store.schema import idempotency_keys

#: The longest request id accepted (the planner's tool call ids are far shorter).
MAX_REQUEST_ID = 128


def digest(payload: bytes) -> str:
    """The SHA-256 hex digest of a request's canonical bytes (request id cleared)."""
    return hashlib.sha256(payload).hexdigest()


def check_request_id(request_id: str) -> None:
    """Raise ``InvalidArgument`` (REQUEST_ID_TOO_LONG) for an over-long request id."""
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidArgument(
            "REQUEST_ID_TOO_LONG", f"request_id is longer than {MAX_REQUEST_ID} characters"
        )


async def replay_ref(
    session: AsyncSession, *, method: str, human: str, request_id: str, payload_hash: str
) -> str | None:
    """The result reference of an earlier request with this id, or None for a new id.

    Raises ``InvalidArgument`` (REQUEST_ID_REUSED) when the earlier request differed.
    """
    if not request_id:
        return None
    row = (
        await session.execute(
            sa.select(idempotency_keys.c.payload_hash, idempotency_keys.c.result_ref).where(
                idempotency_keys.c.method == method,
                idempotency_keys.c.human == human,
                idempotency_keys.c.request_id == request_id,
            )
        )
    ).first()
    if row is None:
        return None
    if row.payload_hash != payload_hash:
        raise InvalidArgument(
            "REQUEST_ID_REUSED",
            "this request_id was used for a different request",
            {"request_id": request_id},
        )
    return str(row.result_ref)


async def remember(
    session: AsyncSession,
    *,
    method: str,
    human: str,
    request_id: str,
    payload_hash: str,
    result_ref: str,
) -> None:
    """Store the key of a write in the write's transaction (nothing for an empty id)."""
    if not request_id:
        return
    await session.execute(
        sa.insert(idempotency_keys).values(
            method=method,
            human=human,
            request_id=request_id,
            payload_hash=payload_hash,
            result_ref=result_ref,
            create_time=time.time(),
        )
    )
