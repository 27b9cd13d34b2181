"""The planner's own service credentials: one per dependency audience (docs/spec/authority.md).

Every call to a dependency carries ``x-ballet-service-authorization: Bearer <token>``, so
that a backend honours ``x-ballet-actor: planner:<session>`` only from the planner, and
the LLM gateway serves only the planner. Each dependency gets a credential for its own
audience alone (tracker ``ballet-tracker``, skills ``ballet-skills``, knowledge
``ballet-knowledge``, gateway ``ballet-llm-gateway``): a dependency that logs or leaks
what it receives cannot replay it to another (docs/decisions/0153-one-credential-per-audience.md,
which also gives the rotation path).

- Production: ``dependencies.<name>.service_token_file``, a file an operator or the
  platform rotates; it is re-read when its modification time changes, and a token whose
  ``aud`` also names another dependency's audience is refused. If a re-read fails (the
  file is being replaced), the last good token is kept and a WARNING logged.
- Dev mode: minted from the dev secret by the dev service-token issuer, subject
  ``service:ballet-planner``, one audience each, and re-minted before it expires.
- Neither: the planner proves itself by the channel's mTLS client certificate, and
  ``token()`` is empty (the clients then send no header).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import jwt

from ballet_common.tokens import (
    DEPENDENCY_AUDIENCES,
    PLANNER_SERVICE_SUBJECT,
    SERVICE_AUTHORIZATION_HEADER,
    mint_dev_service_token,
)

log = logging.getLogger(__name__)

DEV_TOKEN_TTL_S = 3600.0
#: A dev token is re-minted when less than this is left of it, in seconds.
DEV_TOKEN_RENEW_S = 600.0


class ServiceCredential:
    """The planner's credential for one ``audience``; ``token()`` is cheap enough to call
    per RPC.

    Give ``token_file`` (production), ``dev_secret`` (dev mode), or neither (the mTLS
    identity of the channel is the credential).
    """

    def __init__(
        self,
        audience: str,
        *,
        token_file: Path | None = None,
        dev_secret: bytes | None = None,
    ) -> None:
        if token_file is not None and dev_secret is not None:
            raise ValueError("give at most one of token_file and dev_secret")
        self.audience = audience
        self._file = token_file
        self._secret = dev_secret
        self._token = ""
        self._valid_until = 0.0
        self._mtime: float | None = None
        self._lock = threading.Lock()

    def token(self) -> str:
        """The credential, without the ``Bearer`` prefix; empty for an mTLS identity.

        Raises ``OSError`` when the token file cannot be read and ``ValueError`` when it
        is empty or names another dependency's audience, unless an earlier read gave a
        token (then that one is kept, with a WARNING).
        """
        if self._secret is not None:
            return self._dev_token(self._secret)
        if self._file is None:
            return ""
        try:
            mtime = self._file.stat().st_mtime
            if mtime != self._mtime:
                with self._lock:
                    text = self._file.read_text().strip()
                    _check_audience(text, self.audience, self._file)
                    self._token, self._mtime = text, mtime
        except (OSError, ValueError) as error:
            if not self._token:
                raise
            log.warning(
                "service credential for %s: keeping the last good token, the file cannot "
                "be used: %s",
                self.audience,
                error,
            )
        return self._token

    def metadata(self) -> list[tuple[str, str]]:
        """The call metadata that carries the credential (none for an mTLS identity)."""
        token = self.token()
        return [(SERVICE_AUTHORIZATION_HEADER, f"Bearer {token}")] if token else []

    def _dev_token(self, secret: bytes) -> str:
        now = time.time()
        if now + DEV_TOKEN_RENEW_S >= self._valid_until:
            with self._lock:
                self._token = mint_dev_service_token(
                    secret,
                    PLANNER_SERVICE_SUBJECT,
                    audiences=(self.audience,),
                    ttl_s=DEV_TOKEN_TTL_S,
                    now=now,
                )
                self._valid_until = now + DEV_TOKEN_TTL_S
        return self._token


def _check_audience(token: str, audience: str, path: Path) -> None:
    if not token:
        raise ValueError(f"service token file {path} is empty")
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return  # an opaque token: only its issuer can tell what it is for
    named = claims.get("aud")
    audiences = {named} if isinstance(named, str) else set(named or ())
    others = audiences & (set(DEPENDENCY_AUDIENCES.values()) - {audience})
    if others:
        raise ValueError(
            f"service token file {path}: the token for {audience} also names "
            f"{', '.join(sorted(others))}; each dependency needs a credential for its "
            "audience alone"
        )


class ServiceCredentials:
    """The planner's credentials by dependency name (``tracker``, ``skills``,
    ``knowledge``, ``gateway``; ``DEPENDENCY_AUDIENCES``)."""

    def __init__(self, by_dependency: Mapping[str, ServiceCredential]) -> None:
        missing = set(DEPENDENCY_AUDIENCES) - set(by_dependency)
        if missing:
            raise ValueError(f"no service credential for {', '.join(sorted(missing))}")
        for name, credential in by_dependency.items():
            if credential.audience != DEPENDENCY_AUDIENCES.get(name):
                raise ValueError(f"the {name} credential is for {credential.audience}")
        self._by_dependency = dict(by_dependency)

    @classmethod
    def build(
        cls, token_files: Mapping[str, Path | None], dev_secret: bytes | None
    ) -> ServiceCredentials:
        """One credential per dependency: its token file when given, else minted from
        ``dev_secret`` when given, else the mTLS identity. Raises ``OSError`` or
        ``ValueError`` when a token file cannot be used."""
        made: dict[str, ServiceCredential] = {}
        for name, audience in DEPENDENCY_AUDIENCES.items():
            token_file = token_files.get(name)
            if token_file is not None:
                made[name] = ServiceCredential(audience, token_file=token_file)
                made[name].token()  # a bad file fails start-up, not the first call
            else:
                made[name] = ServiceCredential(audience, dev_secret=dev_secret)
        return cls(made)

    def __getitem__(self, dependency: str) -> ServiceCredential:
        """The credential for ``dependency`` (``tracker``, ``skills``, ``knowledge``,
        ``gateway``); ``KeyError`` for another name."""
        return self._by_dependency[dependency]
