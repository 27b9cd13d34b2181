"""The planner's own service credentials: one per dependency audience,
dev-minted by the service-token issuer, read from a file, or none (mTLS)."""

from __future__ import annotations

import os
from pathlib import Path

import jwt
import pytest

from ballet_common.tokens import (
    DEPENDENCY_AUDIENCES,
    DEV_SERVICE_ISSUER,
    GATEWAY_AUDIENCE,
    PLANNER_SERVICE_SUBJECT,
    TRACKER_AUDIENCE,
    Trust,
    dev_service_key,
    mint_dev_service_token,
)
from service.server.credentials import ServiceCredential, ServiceCredentials

SECRET = b"0123456789abcdef0123456789abcdef"


def touch(path: Path, text: str, bump_s: float) -> None:
    """Write ``text`` and move the modification time on, so a re-read is due."""
    before = path.stat().st_mtime if path.exists() else 0.0
    path.write_text(text)
    os.utime(path, (before + bump_s, before + bump_s))


def test_each_dev_credential_names_its_dependency_alone() -> None:
    credentials = ServiceCredentials.build({}, SECRET)
    tokens = set()
    for name, audience in DEPENDENCY_AUDIENCES.items():
        token = credentials[name].token()
        claims = jwt.decode(
            token, dev_service_key(SECRET), algorithms=["HS256"], audience=audience
        )
        assert claims["sub"] == PLANNER_SERVICE_SUBJECT
        assert claims["iss"] == DEV_SERVICE_ISSUER
        assert claims["aud"] == [audience]
        assert credentials[name].token() == token  # reused until close to expiry
        assert credentials[name].metadata() == [
            ("x-ballet-service-authorization", f"Bearer {token}")
        ]
        tokens.add(token)
    assert len(tokens) == 4


def test_a_dev_credential_verifies_only_at_its_own_dependency() -> None:
    trust = Trust.dev(SECRET)
    gateway_token = ServiceCredential(GATEWAY_AUDIENCE, dev_secret=SECRET).token()
    assert trust.verifier(GATEWAY_AUDIENCE, humans=False).verify(gateway_token).service
    for audience in set(DEPENDENCY_AUDIENCES.values()) - {GATEWAY_AUDIENCE}:
        with pytest.raises(Exception, match="not meant for this service"):
            trust.verifier(audience, humans=False).verify(gateway_token)
    # Signed with the service issuer's key, never the human one: a human verifier refuses it.
    with pytest.raises(Exception, match="issuer"):
        trust.verifier(GATEWAY_AUDIENCE, services=False).verify(gateway_token)


def test_token_file_is_reread_when_it_changes_and_a_bad_rewrite_keeps_the_last(
    tmp_path: Path,
) -> None:
    path = tmp_path / "token"
    touch(path, "first\n", 0)
    credential = ServiceCredential(TRACKER_AUDIENCE, token_file=path)
    assert credential.token() == "first"
    touch(path, "second\n", 10)
    assert credential.token() == "second"
    touch(path, "", 20)  # a rotation caught half-way: keep serving with the last good one
    assert credential.token() == "second"
    fresh = ServiceCredential(TRACKER_AUDIENCE, token_file=path)
    with pytest.raises(ValueError, match="empty"):
        fresh.token()


def test_a_token_file_naming_another_dependency_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tracker-token"
    shared = mint_dev_service_token(
        SECRET, PLANNER_SERVICE_SUBJECT, audiences=(TRACKER_AUDIENCE, GATEWAY_AUDIENCE)
    )
    touch(path, shared, 0)
    with pytest.raises(ValueError, match="ballet-llm-gateway"):
        ServiceCredentials.build({"tracker": path}, SECRET)
    own = mint_dev_service_token(SECRET, PLANNER_SERVICE_SUBJECT, audiences=(TRACKER_AUDIENCE,))
    touch(path, own, 10)
    credentials = ServiceCredentials.build({"tracker": path}, None)
    assert credentials["tracker"].token() == own
    assert credentials["gateway"].token() == ""  # no file, no secret: the mTLS identity


def test_no_credential_means_the_mtls_identity() -> None:
    credential = ServiceCredential(TRACKER_AUDIENCE)
    assert credential.token() == ""
    assert credential.metadata() == []
    with pytest.raises(ValueError):
        ServiceCredential(TRACKER_AUDIENCE, token_file=Path("t"), dev_secret=SECRET)
    with pytest.raises(ValueError, match="gateway"):
        ServiceCredentials({"tracker": credential})
