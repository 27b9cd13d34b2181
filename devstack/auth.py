"""Who is calling a devstack backend: the human, and the actor the planner claims to be.

SPEC section 4: every call carries the human's ``authorization: Bearer <JWT>``, checked
against *this* backend's audience; the planner adds ``x-ballet-actor: planner:<session>``
and its own service credential ``x-ballet-service-authorization: Bearer <JWT>``. The actor
is honoured only when that credential verifies for this backend's audience and its
subject is the planner (``PLANNER_SERVICE_SUBJECT``); otherwise it is recorded as forged
and ignored, so nothing is ever attributed to the planner on a client's say-so.

The permissions are the seed's Needs column (Tools table); roles grant them per project
(see docs/decisions/0101-devstack-permission-model.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from devstack.errors import Unauthenticated
from service.tokens import PLANNER_SERVICE_SUBJECT, TokenError, TokenVerifier, bearer

TRACKER_READ = "tracker.read"
TRACKER_WRITE = "tracker.write"
SKILL_READ = "skill.read"
KNOWLEDGE_READ = "knowledge.read"
KNOWLEDGE_WRITE = "knowledge.write"
ALL_PERMISSIONS = (TRACKER_READ, TRACKER_WRITE, SKILL_READ, KNOWLEDGE_READ, KNOWLEDGE_WRITE)

#: What each project role grants. ``maintainer`` is alice's role, ``viewer`` bob's (SPEC 9).
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "maintainer": frozenset(ALL_PERMISSIONS),
    "viewer": frozenset({TRACKER_READ, SKILL_READ, KNOWLEDGE_READ}),
    # Roles of the test users dave and erin: they see a project but may read nothing of
    # it, or only its skills (so PERMISSION_DENIED and search's split can be tested).
    "guest": frozenset(),
    "skill-reader": frozenset({SKILL_READ}),
}

ACTOR_HEADER = "x-ballet-actor"
SERVICE_AUTHORIZATION_HEADER = "x-ballet-service-authorization"
#: The only actors a planner credential may claim: ``planner:<session_id>``.
PLANNER_ACTOR_PREFIX = "planner:"


@dataclass(frozen=True)
class Caller:
    """The identity of one backend call.

    ``human`` is the verified token's ``sub`` and ``organization_id`` its ``org``;
    ``actor`` is the honoured ``x-ballet-actor`` (empty when absent or not honoured);
    ``actor_header`` is the raw header as sent (None when absent), kept for the call record.
    """

    human: str
    organization_id: str
    actor: str = ""
    actor_header: str | None = None

    @property
    def recorded_by(self) -> str:
        """Who a write is recorded as made by: the honoured actor, else the human."""
        return self.actor or self.human

    @property
    def actor_forged(self) -> bool:
        """True when an actor header was sent but not honoured."""
        return self.actor_header is not None and not self.actor

    @property
    def is_planner(self) -> bool:
        """True when the planner (with a verified credential) makes the call."""
        return self.actor.startswith(PLANNER_ACTOR_PREFIX)


@dataclass(frozen=True)
class Identification:
    """What could be learnt from a call's metadata: a caller, or why there is none."""

    caller: Caller | None
    error: Unauthenticated | None
    actor_header: str | None


class Authenticator:
    """Resolves the caller of a call to one backend (one audience)."""

    def __init__(self, verifier: TokenVerifier) -> None:
        self._verifier = verifier

    def identify(self, metadata: Iterable[tuple[str, str | bytes]]) -> Identification:
        """Verify the human token and decide whether the actor header is honoured.

        Never raises: a missing or bad token gives ``error`` (an ``Unauthenticated`` whose
        reason is the ``TokenError`` reason: TOKEN_MISSING, TOKEN_INVALID, TOKEN_EXPIRED,
        WRONG_AUDIENCE), so the caller can still record the call before refusing it.
        """
        pairs = list(metadata)
        actor_header = _header(pairs, ACTOR_HEADER)
        try:
            claims = self._verifier.verify(bearer(pairs))
        except TokenError as error:
            return Identification(None, Unauthenticated(error.reason, error.message), actor_header)
        claimed = actor_header or ""
        honoured = (
            claimed.startswith(PLANNER_ACTOR_PREFIX)
            and len(claimed) > len(PLANNER_ACTOR_PREFIX)
            and self._planner_credential_ok(pairs)
        )
        actor = claimed if honoured else ""
        caller = Caller(
            human=claims.subject,
            organization_id=claims.organization_id,
            actor=actor,
            actor_header=actor_header,
        )
        return Identification(caller, None, actor_header)

    def _planner_credential_ok(self, pairs: list[tuple[str, str | bytes]]) -> bool:
        token = bearer(pairs, SERVICE_AUTHORIZATION_HEADER)
        if token is None:
            return False
        try:
            claims = self._verifier.verify(token)
        except TokenError:
            # A bad credential is treated like none: the actor is ignored, not trusted.
            return False
        return claims.subject == PLANNER_SERVICE_SUBJECT


def _header(pairs: list[tuple[str, str | bytes]], key: str) -> str | None:
    for name, value in pairs:
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None
