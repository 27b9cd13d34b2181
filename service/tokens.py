"""Bearer tokens: verifying Core-issued JWTs, and minting dev tokens (SPEC section 4).

Shared by the planner's transport and the devstack backends, so every service checks
tokens the same way and each checks its own audience.

- Production keys come from a JWKS file (RFC 7517); a key is chosen by the token's
  ``kid`` and its ``alg`` member fixes the algorithm (EdDSA or RS256). The file is re-read
  when its modification time changes, so keys rotate without a restart.
- Dev mode (no key file configured) uses an HS256 secret generated at first run in the
  data directory (``dev-secret``); it is never committed and never leaves the machine.
- ``none`` is never accepted; HS256 only in dev mode; leeway is capped at 60 s.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt

PLANNER_AUDIENCE = "ballet-planner"
TRACKER_AUDIENCE = "ballet-tracker"
SKILLS_AUDIENCE = "ballet-skills"
KNOWLEDGE_AUDIENCE = "ballet-knowledge"
GATEWAY_AUDIENCE = "ballet-llm-gateway"
#: The audiences a human's token carries: the planner and the backends it calls for them.
HUMAN_AUDIENCES = (PLANNER_AUDIENCE, TRACKER_AUDIENCE, SKILLS_AUDIENCE, KNOWLEDGE_AUDIENCE)
#: The subject of the planner's own service credential.
PLANNER_SERVICE_SUBJECT = "service:ballet-planner"
DEV_ISSUER = "ballet-core-dev"
DEV_KID = "dev"
DEV_SECRET_FILE = "dev-secret"
MAX_LEEWAY_S = 60.0
_PRODUCTION_ALGORITHMS = frozenset({"EdDSA", "RS256"})


class TokenError(Exception):
    """A token is missing, malformed, expired, forged or meant for another audience.

    ``reason`` is a stable UPPER_SNAKE value (``TOKEN_MISSING``, ``TOKEN_EXPIRED``,
    ``TOKEN_INVALID``, ``WRONG_AUDIENCE``) for the ``ErrorInfo`` of an UNAUTHENTICATED.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Claims:
    """The verified identity in a token.

    ``subject`` is the human id (or a service's name); ``organization_id`` the ``org``
    claim; ``scopes`` the space-separated ``scope`` claim, present only on service
    principals; ``expires_at`` is seconds since the epoch.
    """

    subject: str
    organization_id: str
    issuer: str
    audiences: frozenset[str]
    expires_at: float
    scopes: frozenset[str] = field(default_factory=frozenset)
    raw: str = field(default="", repr=False, compare=False)

    @property
    def is_service(self) -> bool:
        """True for a service principal (a token with a ``scope`` claim)."""
        return bool(self.scopes)

    def expired(self, now: float | None = None) -> bool:
        """True once ``exp`` has passed (no leeway: used for open streams)."""
        return (time.time() if now is None else now) >= self.expires_at


def dev_secret(data_dir: Path, *, create: bool = True) -> bytes:
    """Return the dev HS256 secret of ``data_dir``, generating it on first use.

    Raises ``FileNotFoundError`` when it does not exist and ``create`` is false.
    """
    path = data_dir / DEV_SECRET_FILE
    if not path.exists():
        if not create:
            raise FileNotFoundError(f"no dev secret in {data_dir}; run the planner once first")
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
    return path.read_text().strip().encode()


def mint_dev_token(
    secret: bytes,
    subject: str,
    *,
    organization_id: str = "acme",
    audiences: Iterable[str] = HUMAN_AUDIENCES,
    ttl_s: float = 12 * 3600,
    scopes: Iterable[str] = (),
    issuer: str = DEV_ISSUER,
    now: float | None = None,
) -> str:
    """Mint an HS256 dev token; ``ttl_s`` is its lifetime in seconds (may be negative)."""
    issued = time.time() if now is None else now
    payload: dict[str, Any] = {
        "sub": subject,
        "org": organization_id,
        "iss": issuer,
        "aud": list(audiences),
        "iat": int(issued),
        "exp": int(issued + ttl_s),
    }
    scope = " ".join(scopes)
    if scope:
        payload["scope"] = scope
    return jwt.encode(payload, secret, algorithm="HS256", headers={"kid": DEV_KID})


class KeySet:
    """Verification keys by ``kid``: a JWKS file re-read on change, or the dev secret."""

    def __init__(self, *, jwks_path: Path | None = None, dev_secret: bytes | None = None) -> None:
        if (jwks_path is None) == (dev_secret is None):
            raise ValueError("give exactly one of jwks_path and dev_secret")
        self._path = jwks_path
        self._dev_secret = dev_secret
        self._keys: dict[str, tuple[Any, str]] = {}
        self._mtime: float | None = None
        self._lock = threading.Lock()

    @property
    def dev_mode(self) -> bool:
        """True when tokens are checked with the generated HS256 dev secret."""
        return self._dev_secret is not None

    def key_for(self, kid: str | None) -> tuple[Any, str]:
        """Return ``(key, algorithm)`` for ``kid``; raises ``TokenError`` when unknown."""
        if self._dev_secret is not None:
            if kid not in (None, DEV_KID):
                raise TokenError("TOKEN_INVALID", "unknown key id")
            return self._dev_secret, "HS256"
        self._reload_if_changed()
        if kid is None or kid not in self._keys:
            raise TokenError("TOKEN_INVALID", "unknown key id")
        return self._keys[kid]

    def _reload_if_changed(self) -> None:
        assert self._path is not None
        mtime = self._path.stat().st_mtime
        if mtime == self._mtime:
            return
        with self._lock:
            document = json.loads(self._path.read_text())
            keys: dict[str, tuple[Any, str]] = {}
            for jwk in document.get("keys", []):
                algorithm = jwk.get("alg")
                kid = jwk.get("kid")
                if algorithm not in _PRODUCTION_ALGORITHMS or not kid:
                    raise ValueError(
                        f"key set {self._path}: every key needs a kid and alg EdDSA or RS256"
                    )
                keys[kid] = (jwt.PyJWK.from_dict(jwk, algorithm=algorithm).key, algorithm)
            self._keys = keys
            self._mtime = mtime


class TokenVerifier:
    """Verifies bearer tokens for one audience (each service checks its own)."""

    def __init__(
        self, keys: KeySet, *, audience: str, issuers: Iterable[str] = (), leeway_s: float = 30.0
    ) -> None:
        if not 0 <= leeway_s <= MAX_LEEWAY_S:
            raise ValueError(f"leeway must be between 0 and {MAX_LEEWAY_S:g} s")
        self._keys = keys
        self._audience = audience
        self._issuers = tuple(issuers)
        self._leeway = leeway_s

    @property
    def dev_mode(self) -> bool:
        """True when the key set is the dev secret."""
        return self._keys.dev_mode

    def verify(self, token: str | None) -> Claims:
        """Verify ``token`` (without the ``Bearer`` prefix) and return its claims.

        Raises ``TokenError`` (missing, malformed, bad signature, unknown ``kid``, ``none``
        or an algorithm other than the key's, expired, wrong audience or issuer, no ``sub``
        or ``org``).
        """
        if not token:
            raise TokenError("TOKEN_MISSING", "a bearer token is required")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as error:
            raise TokenError("TOKEN_INVALID", "malformed token") from error
        key, algorithm = self._keys.key_for(header.get("kid"))
        if header.get("alg") != algorithm:
            raise TokenError("TOKEN_INVALID", "token algorithm does not match its key")
        try:
            payload = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=self._audience,
                issuer=self._issuers or None,
                leeway=self._leeway,
                options={"require": ["exp", "sub", "aud", "iss"]},
            )
        except jwt.ExpiredSignatureError as error:
            raise TokenError("TOKEN_EXPIRED", "the token has expired") from error
        except jwt.InvalidAudienceError as error:
            raise TokenError("WRONG_AUDIENCE", "the token is not meant for this service") from error
        except jwt.PyJWTError as error:
            raise TokenError("TOKEN_INVALID", f"invalid token: {error}") from error
        return _claims(payload, token)


def _claims(payload: Mapping[str, Any], raw: str) -> Claims:
    subject = payload.get("sub")
    organization = payload.get("org")
    if not isinstance(subject, str) or not subject:
        raise TokenError("TOKEN_INVALID", "the token has no subject")
    if not isinstance(organization, str) or not organization:
        raise TokenError("TOKEN_INVALID", "the token has no organization")
    audience = payload.get("aud")
    audiences = frozenset([audience] if isinstance(audience, str) else audience or [])
    scope = payload.get("scope")
    scopes = frozenset(scope.split()) if isinstance(scope, str) else frozenset()
    return Claims(
        subject=subject,
        organization_id=organization,
        issuer=str(payload.get("iss", "")),
        audiences=audiences,
        expires_at=float(payload["exp"]),
        scopes=scopes,
        raw=raw,
    )


def bearer(metadata: Iterable[tuple[str, str | bytes]], key: str = "authorization") -> str | None:
    """Return the token of a ``Bearer`` header named ``key`` in gRPC metadata, or None."""
    for name, value in metadata:
        if name == key:
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None
