"""Who is calling: bearer token verification for every PlannerService call (SPEC 4).

Each PlannerService method calls ``Authenticator.authenticate(context)`` first; the Chat
servicer calls it once when the stream starts and then checks ``claims.expired()`` on
every client message. Health checking and reflection are separate services and never
call it, so they need no token.

A failure raises ``service.core.errors.Unauthenticated`` with the reason of the
``TokenError`` (``TOKEN_MISSING``, ``TOKEN_EXPIRED``, ``TOKEN_INVALID``,
``WRONG_AUDIENCE``); ``service.transport.errors`` maps it to ``UNAUTHENTICATED``.
"""

from __future__ import annotations

from typing import Any

from service.core.errors import Unauthenticated
from service.core.sessions import Caller
from service.tokens import Claims, TokenError, TokenVerifier, bearer


class Authenticator:
    """Verifies the ``authorization: Bearer <JWT>`` metadata of a call.

    ``verifier`` must check the planner's audience (``ballet-planner``).
    """

    def __init__(self, verifier: TokenVerifier) -> None:
        self._verifier = verifier

    @property
    def dev_mode(self) -> bool:
        """True when tokens are checked with the dev secret."""
        return self._verifier.dev_mode

    def authenticate(self, context: Any) -> Claims:
        """Verify the call's bearer token and return its claims.

        ``context`` is the call's ``grpc.aio.ServicerContext``. Raises ``Unauthenticated``
        with reason ``TOKEN_MISSING`` (no or empty header, or a scheme other than
        ``Bearer``), ``TOKEN_EXPIRED``, ``TOKEN_INVALID`` (malformed, forged, unknown key,
        wrong issuer) or ``WRONG_AUDIENCE``.
        """
        token = bearer(context.invocation_metadata() or ())
        try:
            return self._verifier.verify(token)
        except TokenError as error:
            raise Unauthenticated(error.message, reason=error.reason) from None

    def caller(self, context: Any) -> Caller:
        """``authenticate``, then the caller as the session rules see it."""
        return caller_from_claims(self.authenticate(context))


def caller_from_claims(claims: Claims) -> Caller:
    """The core's view of verified claims: subject, organization, scopes, raw token."""
    return Caller(
        subject=claims.subject,
        organization_id=claims.organization_id,
        scopes=claims.scopes,
        token=claims.raw,
    )
