"""Who is calling: bearer token verification for every PlannerService call (docs/spec/authority.md).

Each PlannerService method calls ``Authenticator.authenticate(context)`` first; the Chat
stream authenticates once when it starts, and the core then checks ``Caller.expired``
on every client message (``service.core.chat``). Health checking and reflection are
separate services and never call it, so they need no token.

Humans and service principals are told apart by the issuer that signed the token
(``ballet_common.tokens``; docs/decisions/0150-service-principals.md), never by a claim:
a human token carrying ``scope`` is refused.

A failure raises ``service.core.errors.Unauthenticated`` with the reason of the
``TokenError`` (``TOKEN_MISSING``, ``TOKEN_EXPIRED``, ``TOKEN_INVALID``,
``WRONG_AUDIENCE``, ``SCOPE_NOT_ALLOWED``); ``service.transport.errors`` maps it to
``UNAUTHENTICATED``.
"""

from __future__ import annotations

from ballet_common.tokens import Claims, TokenError, TokenVerifier, bearer
from service.core.errors import Unauthenticated
from service.core.sessions import Caller
from service.transport.errors import Context


class Authenticator:
    """Verifies the ``authorization: Bearer <JWT>`` metadata of a call.

    ``verifier`` must check the planner's audience (``ballet-planner``) and trust Core's
    human issuer and, when service principals may call, the service-token issuer.
    """

    def __init__(self, verifier: TokenVerifier) -> None:
        self._verifier = verifier

    @property
    def dev_mode(self) -> bool:
        """True when tokens are checked with the dev secret."""
        return self._verifier.dev_mode

    def authenticate(self, context: Context) -> Claims:
        """Verify the call's bearer token and return its claims.

        Raises ``Unauthenticated``
        with reason ``TOKEN_MISSING`` (no or empty header, or a scheme other than
        ``Bearer``), ``TOKEN_EXPIRED``, ``TOKEN_INVALID`` (malformed, forged, unknown key
        or issuer, no organization), ``WRONG_AUDIENCE`` or ``SCOPE_NOT_ALLOWED`` (a human
        token carrying ``scope``).
        """
        token = bearer(context.invocation_metadata() or ())
        try:
            claims = self._verifier.verify(token)
        except TokenError as error:
            raise Unauthenticated(error.message, reason=error.reason) from None
        if not claims.organization_id:
            # Service principals read "only within the token's org" (docs/spec/authority.md): one
            # without an organization has nothing it could read.
            raise Unauthenticated("the token has no organization", reason="TOKEN_INVALID")
        return claims

    def caller(self, context: Context) -> Caller:
        """``authenticate``, then the caller as the session rules see it."""
        return caller_from_claims(self.authenticate(context))


def caller_from_claims(claims: Claims) -> Caller:
    """The core's view of verified claims: subject, organization, whether it is a
    service principal and its scopes, raw token."""
    return Caller(
        subject=claims.subject,
        organization_id=claims.organization_id,
        service=claims.service,
        scopes=claims.scopes,
        token=claims.raw,
        expires_at=claims.expires_at,
    )
