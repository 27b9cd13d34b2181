"""The planner's own service credential (SPEC section 4, Identity and authority).

Every backend call carries ``x-ballet-service-authorization: Bearer <token>`` so that a
backend honours ``x-ballet-actor: planner:<session>`` only from the planner. In
production the token comes from ``dependencies.service_token_file`` (a file an operator
or the platform rotates; it is re-read when its modification time changes). In dev mode
it is minted from the dev secret with subject ``service:ballet-planner`` and re-minted
before it expires. With neither, the planner proves itself by its mTLS client certificate
and ``token()`` is empty (the backend clients then send no header).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from service.tokens import (
    GATEWAY_AUDIENCE,
    KNOWLEDGE_AUDIENCE,
    PLANNER_SERVICE_SUBJECT,
    SKILLS_AUDIENCE,
    TRACKER_AUDIENCE,
    mint_dev_token,
)

#: Audiences of the dev credential: every service the planner calls.
SERVICE_AUDIENCES = (TRACKER_AUDIENCE, SKILLS_AUDIENCE, KNOWLEDGE_AUDIENCE, GATEWAY_AUDIENCE)
DEV_TOKEN_TTL_S = 3600.0
#: A dev token is re-minted when less than this is left of it, in seconds.
DEV_TOKEN_RENEW_S = 600.0


class ServiceCredential:
    """``token()`` returns the current credential; cheap enough to call per RPC.

    Give ``token_file`` (production), ``dev_secret`` (dev mode), or neither (the mTLS
    identity of the channels is the credential).
    """

    def __init__(self, *, token_file: Path | None = None, dev_secret: bytes | None = None):
        if token_file is not None and dev_secret is not None:
            raise ValueError("give at most one of token_file and dev_secret")
        self._file = token_file
        self._secret = dev_secret
        self._token = ""
        self._valid_until = 0.0
        self._mtime: float | None = None
        self._lock = threading.Lock()

    def token(self) -> str:
        """The credential, without the ``Bearer`` prefix; empty for an mTLS identity.

        Raises ``OSError`` when the token file cannot be read, ``ValueError`` when it is
        empty.
        """
        if self._secret is not None:
            return self._dev_token(self._secret)
        if self._file is None:
            return ""
        mtime = self._file.stat().st_mtime
        if mtime != self._mtime:
            with self._lock:
                text = self._file.read_text().strip()
                if not text:
                    raise ValueError(f"service token file {self._file} is empty")
                self._token, self._mtime = text, mtime
        return self._token

    def _dev_token(self, secret: bytes) -> str:
        now = time.time()
        if now + DEV_TOKEN_RENEW_S >= self._valid_until:
            with self._lock:
                self._token = mint_dev_token(
                    secret,
                    PLANNER_SERVICE_SUBJECT,
                    audiences=SERVICE_AUDIENCES,
                    ttl_s=DEV_TOKEN_TTL_S,
                    now=now,
                )
                self._valid_until = now + DEV_TOKEN_TTL_S
        return self._token
