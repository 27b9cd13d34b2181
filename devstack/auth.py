"""Who is calling a devstack backend: the human, and the actor the planner claims to be.

docs/spec/authority.md: every call carries the human's ``authorization: Bearer <JWT>``, checked
against *this* backend's audience and Core's human issuer; the planner adds
``x-ballet-actor: planner:<session>`` and its own service credential
``x-ballet-service-authorization: Bearer <JWT>``.

- The credential must be a token of the service-token issuer for *this* backend's
  audience alone (the planner holds one per dependency): one that fails that
  (another audience, several audiences, another issuer, expired, forged) refuses the call
  ``UNAUTHENTICATED``/``SERVICE_CREDENTIAL_INVALID``, so what the LLM gateway or another
  backend receives cannot be replayed here.
- The actor is honoured only when that credential's subject is the planner
  (``PLANNER_SERVICE_SUBJECT``); otherwise (no credential, or another service's) it is
  recorded as forged and ignored, so nothing is ever attributed to the planner on a
  client's say-so.

The permissions are those the tools need (docs/spec/authority.md); roles grant them per project
(see docs/decisions/0101-devstack-permission-model.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ballet_common.tokens import (
    ACTOR_HEADER,
    PLANNER_SERVICE_SUBJECT,
    SERVICE_AUTHORIZATION_HEADER,
    Claims,
    TokenError,
    TokenVerifier,
    Trust,
    bearer,
)
from devstack.errors import Unauthenticated

TRACKER_READ = "tracker.read"
TRACKER_WRITE = "tracker.write"
SKILL_READ = "skill.read"
KNOWLEDGE_READ = "knowledge.read"
KNOWLEDGE_WRITE = "knowledge.write"
ALL_PERMISSIONS = (TRACKER_READ, TRACKER_WRITE, SKILL_READ, KNOWLEDGE_READ, KNOWLEDGE_WRITE)

#: What each project role grants. ``maintainer`` is alice's role, ``viewer`` bob's (README.md).
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "maintainer": frozenset(ALL_PERMISSIONS),
    "viewer": frozenset({TRACKER_READ, SKILL_READ, KNOWLEDGE_READ}),
    # Roles of the test users dave and erin: they see a project but may read nothing of
    # it, or only its skills (so PERMISSION_DENIED and search's split can be tested).
    "guest": frozenset(),
    "skill-reader": frozenset({SKILL_READ}),
}

#: What each role lets a human do, as the dev banner says it.
ROLE_SUMMARIES = {
    "maintainer": "all five permissions",
    "viewer": "read permissions only",
    # The planner reads the project as the human to open a session (tracker.read): it
    # refuses both of these the project; they are for the backends' permission checks.
    "guest": "no permission: the planner refuses the project",
    "skill-reader": "skill.read only: the planner refuses the project",
}

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


class ServiceCredentialVerifier:
    """Checks the ``x-ballet-service-authorization`` credential of a call to one
    dependency (one audience): a token of the service-token issuer naming this audience
    and no other."""

    def __init__(self, trust: Trust, audience: str, *, leeway_s: float = 30.0) -> None:
        self._verifier: TokenVerifier | None = (
            trust.verifier(audience, leeway_s=leeway_s, humans=False)
            if trust.services is not None
            else None
        )
        self._audience = audience

    def verify(self, metadata: Iterable[tuple[str, str | bytes]]) -> Claims | None:
        """The credential's claims; None when the call carries none. Raises
        ``Unauthenticated``/``SERVICE_CREDENTIAL_INVALID`` (the ``TokenError`` reason in
        the metadata as ``credential_reason``) for one that does not verify here."""
        token = bearer(metadata, SERVICE_AUTHORIZATION_HEADER)
        if token is None:
            return None
        if self._verifier is None:
            raise _bad_credential("TOKEN_INVALID", "no service-token issuer is trusted here")
        try:
            claims = self._verifier.verify(token)
        except TokenError as error:
            raise _bad_credential(error.reason, error.message) from None
        if claims.audiences != {self._audience}:
            # Valid here, but also valid elsewhere: whoever else received it could
            # replay it here, which is what one credential per audience prevents.
            raise _bad_credential(
                "WRONG_AUDIENCE", "the credential names other audiences besides this one"
            )
        return claims


def _bad_credential(reason: str, message: str) -> Unauthenticated:
    return Unauthenticated(
        "SERVICE_CREDENTIAL_INVALID",
        f"the x-ballet-service-authorization credential is not valid here: {message}",
        {"credential_reason": reason},
    )


class Authenticator:
    """Resolves the caller of a call to one backend (one audience): humans by Core's
    human issuer, the planner's credential by the service-token issuer."""

    def __init__(self, trust: Trust, audience: str, *, leeway_s: float = 30.0) -> None:
        self._humans = trust.verifier(audience, leeway_s=leeway_s, services=False)
        self._credentials = ServiceCredentialVerifier(trust, audience, leeway_s=leeway_s)

    def identify(self, metadata: Iterable[tuple[str, str | bytes]]) -> Identification:
        """Verify the human token and the service credential, and decide whether the
        actor header is honoured.

        Never raises: a refusal gives ``error`` (an ``Unauthenticated`` whose reason is
        the human token's ``TokenError`` reason: TOKEN_MISSING, TOKEN_INVALID,
        TOKEN_EXPIRED, WRONG_AUDIENCE, SCOPE_NOT_ALLOWED; or SERVICE_CREDENTIAL_INVALID),
        so the caller can still record the call before refusing it.
        """
        pairs = list(metadata)
        actor_header = _header(pairs, ACTOR_HEADER)
        try:
            claims = self._humans.verify(bearer(pairs))
            credential = self._credentials.verify(pairs)
        except TokenError as error:
            return Identification(None, Unauthenticated(error.reason, error.message), actor_header)
        except Unauthenticated as refusal:
            return Identification(None, refusal, actor_header)
        claimed = actor_header or ""
        honoured = (
            credential is not None
            and credential.subject == PLANNER_SERVICE_SUBJECT
            and claimed.startswith(PLANNER_ACTOR_PREFIX)
            and len(claimed) > len(PLANNER_ACTOR_PREFIX)
        )
        caller = Caller(
            human=claims.subject,
            organization_id=claims.organization_id,
            actor=claimed if honoured else "",
            actor_header=actor_header,
        )
        return Identification(caller, None, actor_header)


def _header(pairs: list[tuple[str, str | bytes]], key: str) -> str | None:
    for name, value in pairs:
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None
