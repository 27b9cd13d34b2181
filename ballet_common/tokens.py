"""Bearer tokens, shared by the planner and the devstack (docs/spec/authority.md).

Every service verifies tokens the same way and checks its own audience; both kinds of
principal are told apart by proof, never by a claim anyone could add:

- **Humans** carry tokens of Core's human issuer (``iss`` one of its names, signed with
  its keys). A human token never carries ``scope``: one that does is refused
  (``SCOPE_NOT_ALLOWED``), so adding a claim cannot turn a human into a service.
- **Services** (a reporting job with ``planner.sessions.read``, the planner's own
  credential for its dependencies) carry tokens of the service-token issuer: another
  ``iss`` value, checked with that issuer's own keys. Only such a token is a service
  principal (``Claims.service``); its ``scope`` claim lists what it may do.
  docs/decisions/0150-service-principals.md gives the threat model.

Keys:

- Production keys come from JWKS files (RFC 7517), one per issuer (the two may share a
  file: then the ``iss`` value alone tells them apart); a key is chosen by the token's
  ``kid`` and its ``alg`` member fixes the algorithm (EdDSA or RS256). A file is re-read
  when its modification time changes, so keys rotate without a restart.
- Dev mode uses an HS256 secret generated at first run in the data directory
  (``dev-secret``, ``0600`` in a ``0700`` directory). Human dev tokens are signed with it;
  service dev tokens with a key derived from it (``dev_service_key``) under their own
  issuer and ``kid``, so the dev setup has the same two-issuer shape as production.
- ``none`` is never accepted; HS256 only in dev mode; leeway is capped at 60 s.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt

from ballet_common.files import create_private_file, exposed

log = logging.getLogger(__name__)

PLANNER_AUDIENCE = "ballet-planner"
TRACKER_AUDIENCE = "ballet-tracker"
SKILLS_AUDIENCE = "ballet-skills"
KNOWLEDGE_AUDIENCE = "ballet-knowledge"
GATEWAY_AUDIENCE = "ballet-llm-gateway"
#: The audiences a human's token carries: the planner and the backends it calls for them.
HUMAN_AUDIENCES = (PLANNER_AUDIENCE, TRACKER_AUDIENCE, SKILLS_AUDIENCE, KNOWLEDGE_AUDIENCE)
#: The audience of each dependency of the planner, by its name in the configuration.
#: The planner holds one credential per audience, each accepted by that dependency alone.
DEPENDENCY_AUDIENCES: Mapping[str, str] = {
    "tracker": TRACKER_AUDIENCE,
    "skills": SKILLS_AUDIENCE,
    "knowledge": KNOWLEDGE_AUDIENCE,
    "gateway": GATEWAY_AUDIENCE,
}
#: The subject of the planner's own service credential.
PLANNER_SERVICE_SUBJECT = "service:ballet-planner"
#: The metadata key of the planner's service credential on its dependency calls.
SERVICE_AUTHORIZATION_HEADER = "x-ballet-service-authorization"
#: The metadata key of the actor a backend records, ``planner:<session_id>``.
ACTOR_HEADER = "x-ballet-actor"

#: The issuer of human dev tokens (Core's human issuer in dev mode).
DEV_ISSUER = "ballet-core-dev"
#: The issuer of service dev tokens (Core's service-token issuer in dev mode).
DEV_SERVICE_ISSUER = "ballet-core-dev-services"
DEV_KID = "dev"
DEV_SERVICE_KID = "dev-service"
DEV_SECRET_FILE = "dev-secret"
#: The shortest dev secret accepted, in bytes: HS256's key must be at least as long as
#: its hash output (RFC 7518 section 3.2). A generated secret has 64 (32 random bytes, hex).
MIN_DEV_SECRET_BYTES = 32
#: The longest lifetime of a dev token, in seconds (30 days; docs/decisions/0168).
MAX_DEV_TOKEN_TTL_S = 30 * 24 * 3600.0
#: The lifetime of a dev token when none is asked for (``token``, ``chat --user``): 12 hours.
DEFAULT_DEV_TOKEN_TTL_S = 12 * 3600.0
#: How far ahead of now a token's ``exp`` may lie, in seconds (366 days), for any issuer:
#: further is no issuer's policy but a mistake or a forgery (docs/decisions/0168).
MAX_TOKEN_HORIZON_S = 366 * 24 * 3600.0
MAX_LEEWAY_S = 60.0
_PRODUCTION_ALGORITHMS = frozenset({"EdDSA", "RS256"})
#: Label of the dev service key's derivation (changing it invalidates dev service tokens).
_DEV_SERVICE_KEY_LABEL = b"ballet dev service-token key v1"


class TokenError(Exception):
    """A token is missing, malformed, expired, forged or meant for someone else.

    ``reason`` is a stable UPPER_SNAKE value for the ``ErrorInfo`` of an UNAUTHENTICATED:
    ``TOKEN_MISSING``, ``TOKEN_EXPIRED``, ``TOKEN_INVALID`` (malformed, bad signature,
    unknown key or issuer, missing claims), ``WRONG_AUDIENCE``, ``SCOPE_NOT_ALLOWED`` (a
    human token carrying ``scope``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Claims:
    """The verified identity in a token.

    ``subject`` is the human id, or a service's name; ``organization_id`` the ``org``
    claim (required of humans; may be empty for a service); ``service`` is True only for
    a token of the service-token issuer, and only then are ``scopes`` (the
    space-separated ``scope`` claim) set; ``expires_at`` is seconds since the epoch.
    """

    subject: str
    organization_id: str
    issuer: str
    audiences: frozenset[str]
    expires_at: float
    service: bool = False
    scopes: frozenset[str] = field(default_factory=frozenset)
    raw: str = field(default="", repr=False, compare=False)

    @property
    def is_service(self) -> bool:
        """True for a service principal: proven by its issuer and keys, not by a claim."""
        return self.service

    def expired(self, now: float | None = None) -> bool:
        """True once ``exp`` has passed (no leeway: used for open streams)."""
        return (time.time() if now is None else now) >= self.expires_at


# --------------------------------------------------------------------------- keys


class KeySet:
    """Verification keys by ``kid``: a JWKS file re-read on change, or one dev key."""

    def __init__(
        self,
        *,
        jwks_path: Path | None = None,
        dev_secret: bytes | None = None,
        dev_kid: str = DEV_KID,
    ) -> None:
        if (jwks_path is None) == (dev_secret is None):
            raise ValueError("give exactly one of jwks_path and dev_secret")
        self._path = jwks_path
        self._dev_secret = dev_secret
        self._dev_kid = dev_kid
        self._keys: dict[str, tuple[Any, str]] = {}
        self._mtime: float | None = None
        self._lock = threading.Lock()

    @classmethod
    def dev(cls, secret: bytes, kid: str = DEV_KID) -> KeySet:
        """The HS256 key ``secret`` under ``kid`` (dev mode only)."""
        return cls(dev_secret=secret, dev_kid=kid)

    @property
    def dev_mode(self) -> bool:
        """True when tokens are checked with a generated HS256 dev key."""
        return self._dev_secret is not None

    def key_for(self, kid: str | None) -> tuple[Any, str]:
        """Return ``(key, algorithm)`` for ``kid``; raises ``TokenError`` when unknown."""
        if self._dev_secret is not None:
            if kid not in (None, self._dev_kid):
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


@dataclass(frozen=True)
class Issuer:
    """One trusted issuer: the ``iss`` values it signs with, its keys, and whether its
    tokens are service principals (``service``) or humans."""

    names: tuple[str, ...]
    keys: KeySet
    service: bool = False

    def __post_init__(self) -> None:
        if not self.names or not all(self.names):
            raise ValueError("an issuer needs at least one non-empty iss value")


@dataclass(frozen=True)
class Trust:
    """The issuers a service trusts: Core's human issuer, and the service-token issuer
    (None: no service principal is accepted at all)."""

    humans: Issuer
    services: Issuer | None = None

    def __post_init__(self) -> None:
        if self.humans.service or (self.services is not None and not self.services.service):
            raise ValueError("humans must be a human issuer and services a service issuer")
        if self.services is not None and set(self.humans.names) & set(self.services.names):
            raise ValueError("the human and service issuers must have different iss values")

    @classmethod
    def dev(cls, secret: bytes) -> Trust:
        """Dev mode: humans signed with ``secret`` (``iss`` ``DEV_ISSUER``), services with
        ``dev_service_key(secret)`` (``iss`` ``DEV_SERVICE_ISSUER``)."""
        return cls(
            humans=Issuer((DEV_ISSUER,), KeySet.dev(secret, DEV_KID)),
            services=Issuer(
                (DEV_SERVICE_ISSUER,), KeySet.dev(dev_service_key(secret), DEV_SERVICE_KID), True
            ),
        )

    @property
    def dev_mode(self) -> bool:
        """True when human tokens are checked with the dev secret."""
        return self.humans.keys.dev_mode

    def verifier(
        self,
        audience: str,
        *,
        leeway_s: float = 30.0,
        humans: bool = True,
        services: bool = True,
    ) -> TokenVerifier:
        """A verifier for ``audience`` accepting tokens of the chosen issuers."""
        issuers = []
        if humans:
            issuers.append(self.humans)
        if services and self.services is not None:
            issuers.append(self.services)
        return TokenVerifier(issuers, audience=audience, leeway_s=leeway_s)


# --------------------------------------------------------------------------- verifying


class TokenVerifier:
    """Verifies bearer tokens for one audience (each service checks its own), from the
    given issuers only. The token's ``iss`` picks the issuer; its keys then check the
    signature, so a token cannot move to another issuer by naming it."""

    def __init__(
        self, issuers: Sequence[Issuer], *, audience: str, leeway_s: float = 30.0
    ) -> None:
        if not 0 <= leeway_s <= MAX_LEEWAY_S:
            raise ValueError(f"leeway must be between 0 and {MAX_LEEWAY_S:g} s")
        if not issuers:
            raise ValueError("a verifier needs at least one issuer")
        self._by_name: dict[str, Issuer] = {}
        for issuer in issuers:
            for name in issuer.names:
                if name in self._by_name:
                    raise ValueError(f"iss {name!r} belongs to two issuers")
                self._by_name[name] = issuer
        self._issuers = tuple(issuers)
        self._audience = audience
        self._leeway = leeway_s

    @property
    def audience(self) -> str:
        """The audience a token must carry."""
        return self._audience

    @property
    def dev_mode(self) -> bool:
        """True when the first issuer's keys are a generated dev key."""
        return self._issuers[0].keys.dev_mode

    def verify(self, token: str | None) -> Claims:
        """Verify ``token`` (without the ``Bearer`` prefix) and return its claims.

        Raises ``TokenError``: ``TOKEN_MISSING``; ``TOKEN_INVALID`` (malformed, an issuer
        this verifier does not trust, bad signature, unknown ``kid``, ``none`` or an
        algorithm other than the key's, no ``sub``, no ``org`` on a human token);
        ``TOKEN_EXPIRED``; ``WRONG_AUDIENCE``; ``SCOPE_NOT_ALLOWED`` (a human token with a
        ``scope`` claim). ``TOKEN_INVALID`` too when ``exp`` lies more than
        ``MAX_TOKEN_HORIZON_S`` ahead (decision 0168).
        """
        if not token:
            raise TokenError("TOKEN_MISSING", "a bearer token is required")
        try:
            # Unverified, only to pick the issuer and key: both are checked below.
            unverified = jwt.decode_complete(token, options={"verify_signature": False})
        except jwt.PyJWTError as error:
            raise TokenError("TOKEN_INVALID", "malformed token") from error
        header, claims = unverified["header"], unverified["payload"]
        name = claims.get("iss") if isinstance(claims, dict) else None
        issuer = self._by_name.get(name) if isinstance(name, str) else None
        if issuer is None:
            raise TokenError("TOKEN_INVALID", "the token's issuer is not trusted here")
        key, algorithm = issuer.keys.key_for(header.get("kid"))
        if header.get("alg") != algorithm:
            raise TokenError("TOKEN_INVALID", "token algorithm does not match its key")
        try:
            payload = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=self._audience,
                issuer=issuer.names,
                leeway=self._leeway,
                options={"require": ["exp", "sub", "aud", "iss"]},
            )
        except jwt.ExpiredSignatureError as error:
            raise TokenError("TOKEN_EXPIRED", "the token has expired") from error
        except jwt.InvalidAudienceError as error:
            raise TokenError("WRONG_AUDIENCE", "the token is not meant for this service") from error
        except jwt.PyJWTError as error:
            raise TokenError("TOKEN_INVALID", f"invalid token: {error}") from error
        return _claims(payload, token, service=issuer.service)


def _expires_at(payload: Mapping[str, Any]) -> float:
    """The verified ``exp`` as seconds since the epoch; a value PyJWT let through that is
    not a finite number within ``MAX_TOKEN_HORIZON_S`` of now is ``TOKEN_INVALID``."""
    try:
        expires = float(payload["exp"])
    except (TypeError, ValueError, OverflowError):
        expires = math.inf
    if not expires - time.time() <= MAX_TOKEN_HORIZON_S:
        raise TokenError(
            "TOKEN_INVALID",
            f"the token expires more than {MAX_TOKEN_HORIZON_S / 86400:.0f} days from now",
        )
    return expires


def _claims(payload: Mapping[str, Any], raw: str, *, service: bool) -> Claims:
    subject = payload.get("sub")
    organization = payload.get("org", "")
    if not isinstance(subject, str) or not subject:
        raise TokenError("TOKEN_INVALID", "the token has no subject")
    if not isinstance(organization, str) or (not service and not organization):
        raise TokenError("TOKEN_INVALID", "the token has no organization")
    if not service and "scope" in payload:
        # A scope on a human token is either a mistake or an attempt to pass as a
        # service; neither may be read as a grant (docs/decisions/0150).
        raise TokenError(
            "SCOPE_NOT_ALLOWED",
            "a human's token may not carry a scope claim; service principals use tokens "
            "of the service-token issuer",
        )
    audience = payload.get("aud")
    audiences = frozenset([audience] if isinstance(audience, str) else audience or [])
    scope = payload.get("scope") if service else None
    scopes = frozenset(scope.split()) if isinstance(scope, str) else frozenset()
    return Claims(
        subject=subject,
        organization_id=organization,
        issuer=str(payload.get("iss", "")),
        audiences=audiences,
        expires_at=_expires_at(payload),
        service=service,
        scopes=scopes,
        raw=raw,
    )


def bearer(metadata: Iterable[tuple[str, str | bytes]], key: str = "authorization") -> str | None:
    """Return the token of a ``Bearer`` header named ``key`` in gRPC metadata, or None."""
    for name, value in metadata:
        if name == key:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


# --------------------------------------------------------------------------- dev mode


class DevSecretError(ValueError):
    """The data directory's dev secret cannot sign tokens (too short); ``str(error)`` is
    one line naming the file and how to make a new one."""


def dev_secret(data_dir: Path, *, create: bool = True) -> bytes:
    """Return the dev HS256 secret of ``data_dir``, generating it on first use.

    A new secret is 32 random bytes (hex), written ``0600`` in a ``0700`` directory
    whatever the umask. An existing one readable by other users is still used, with a
    WARNING (anyone who reads it can mint tokens for every dev user), logged once per file
    per process (``serve`` and ``dev`` read it several times). Raises
    ``FileNotFoundError`` when it does not exist and ``create`` is false, ``OSError``
    when it cannot be read or written, ``DevSecretError`` when it holds fewer than
    ``MIN_DEV_SECRET_BYTES`` bytes (an empty or hand-written file; RFC 7518 section 3.2).
    """
    path = data_dir / DEV_SECRET_FILE
    if not path.exists():
        if not create:
            raise FileNotFoundError(f"no dev secret in {data_dir}; run the planner once first")
        create_private_file(path, secrets.token_hex(32).encode())
    secret = path.read_bytes().strip()
    if len(secret) < MIN_DEV_SECRET_BYTES:
        held = "is empty" if not secret else f"holds {len(secret)} bytes"
        raise DevSecretError(
            f"the dev secret {path} {held}, fewer than the {MIN_DEV_SECRET_BYTES} an HS256 "
            "key needs: delete it and start the planner (or run `ballet-planner token "
            "--create-secret`) to make a new one"
        )
    if exposed(path):
        _warn_exposed_once(path)
    return secret


_warned_lock = threading.Lock()
_warned: set[Path] = set()


def _warn_exposed_once(path: Path) -> None:
    key = path.resolve()
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(
        "the dev secret %s is readable by other users (mode %o): anyone who can read "
        "it can mint tokens; run chmod 600 on it",
        path,
        path.stat().st_mode & 0o777,
    )


def dev_service_key(secret: bytes) -> bytes:
    """The key of the dev service-token issuer, derived from the dev secret (HMAC-SHA256
    under a fixed label), so service and human dev tokens never share a key."""
    return hmac.new(secret, _DEV_SERVICE_KEY_LABEL, hashlib.sha256).hexdigest().encode()


def mint_dev_token(
    secret: bytes,
    subject: str,
    *,
    organization_id: str = "acme",
    audiences: Iterable[str] = HUMAN_AUDIENCES,
    ttl_s: float = 12 * 3600,
    issuer: str = DEV_ISSUER,
    now: float | None = None,
    claims: Mapping[str, Any] | None = None,
) -> str:
    """Mint a human's HS256 dev token; ``ttl_s`` is its lifetime in seconds, at most
    ``MAX_DEV_TOKEN_TTL_S`` (may be negative: tests mint expired tokens). ``claims`` adds
    or overrides claims (tests forge tokens with it). Raises ``ValueError`` for a
    lifetime that is not finite or too long."""
    issued = time.time() if now is None else now
    payload: dict[str, Any] = {
        "sub": subject,
        "org": organization_id,
        "iss": issuer,
        "aud": list(audiences),
        "iat": int(issued),
        "exp": _expiry(issued, ttl_s),
    }
    payload.update(claims or {})
    return jwt.encode(payload, secret, algorithm="HS256", headers={"kid": DEV_KID})


def mint_dev_service_token(
    secret: bytes,
    subject: str,
    *,
    audiences: Iterable[str],
    scopes: Iterable[str] = (),
    organization_id: str = "",
    ttl_s: float = 3600.0,
    now: float | None = None,
) -> str:
    """Mint a service principal's dev token from the dev service-token issuer.

    ``secret`` is the dev secret (the key is derived from it); ``audiences`` are the
    services it may call; ``scopes`` become the space-separated ``scope`` claim;
    ``organization_id`` (``org``) is left out when empty; ``ttl_s`` in seconds, at most
    ``MAX_DEV_TOKEN_TTL_S``. Raises ``ValueError`` for a lifetime that is not finite or
    too long.
    """
    issued = time.time() if now is None else now
    payload: dict[str, Any] = {
        "sub": subject,
        "iss": DEV_SERVICE_ISSUER,
        "aud": list(audiences),
        "iat": int(issued),
        "exp": _expiry(issued, ttl_s),
    }
    if organization_id:
        payload["org"] = organization_id
    scope = " ".join(scopes)
    if scope:
        payload["scope"] = scope
    return jwt.encode(
        payload, dev_service_key(secret), algorithm="HS256", headers={"kid": DEV_SERVICE_KID}
    )


def _expiry(issued: float, ttl_s: float) -> int:
    """``exp`` for a token issued at ``issued`` (Unix seconds) living ``ttl_s`` seconds."""
    if not math.isfinite(ttl_s) or ttl_s > MAX_DEV_TOKEN_TTL_S:
        raise ValueError(
            f"a dev token lives at most {MAX_DEV_TOKEN_TTL_S:.0f} s (30 days), not {ttl_s!r}"
        )
    return int(issued + ttl_s)
