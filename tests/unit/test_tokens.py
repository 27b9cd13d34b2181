"""ballet_common.tokens: principals told apart by the issuer that signed the token
(docs/decisions/0150-service-principals.md), each service checking its own audience."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import jwt
import pytest

from ballet_common.tokens import (
    DEV_ISSUER,
    DEV_SERVICE_ISSUER,
    MAX_DEV_TOKEN_TTL_S,
    MAX_TOKEN_HORIZON_S,
    PLANNER_AUDIENCE,
    TRACKER_AUDIENCE,
    DevSecretError,
    Issuer,
    KeySet,
    TokenError,
    Trust,
    dev_secret,
    dev_service_key,
    mint_dev_service_token,
    mint_dev_token,
)

READ = "planner.sessions.read"
SECRET = b"unit-test-dev-secret-0123456789abcdef"
TRUST = Trust.dev(SECRET)
PLANNER = TRUST.verifier(PLANNER_AUDIENCE)


def reason(token: str) -> str:
    with pytest.raises(TokenError) as refused:
        PLANNER.verify(token)
    return refused.value.reason


def test_a_human_token_is_a_human() -> None:
    claims = PLANNER.verify(mint_dev_token(SECRET, "alice"))
    assert (claims.subject, claims.organization_id, claims.issuer) == ("alice", "acme", DEV_ISSUER)
    assert not claims.is_service and claims.scopes == frozenset()


@pytest.mark.parametrize("scope", ["planner.sessions.read", "", ["planner.sessions.read"], 7])
def test_a_human_token_with_any_scope_claim_is_refused(scope: object) -> None:
    assert reason(mint_dev_token(SECRET, "bob", claims={"scope": scope})) == "SCOPE_NOT_ALLOWED"


def test_only_the_service_issuer_makes_a_service_principal() -> None:
    token = mint_dev_service_token(
        SECRET,
        "service:reports",
        audiences=(PLANNER_AUDIENCE,),
        scopes=("planner.sessions.read", "x"),
        organization_id="acme",
    )
    claims = PLANNER.verify(token)
    assert claims.is_service and claims.scopes == {"planner.sessions.read", "x"}
    assert claims.issuer == DEV_SERVICE_ISSUER
    # Naming the service issuer with the human key, or the human issuer with the service
    # key: the signature is checked with the named issuer's keys, so neither passes.
    posing = mint_dev_token(SECRET, "bob", issuer=DEV_SERVICE_ISSUER)
    assert reason(posing) == "TOKEN_INVALID"
    swapped = jwt.encode(
        {"sub": "bob", "org": "acme", "iss": DEV_ISSUER, "aud": [PLANNER_AUDIENCE], "exp": 2**40},
        dev_service_key(SECRET),
        algorithm="HS256",
        headers={"kid": "dev"},
    )
    assert reason(swapped) == "TOKEN_INVALID"


def test_a_verifier_without_the_service_issuer_accepts_no_service() -> None:
    humans_only = TRUST.verifier(PLANNER_AUDIENCE, services=False)
    token = mint_dev_service_token(SECRET, "s", audiences=(PLANNER_AUDIENCE,))
    with pytest.raises(TokenError) as refused:
        humans_only.verify(token)
    assert refused.value.reason == "TOKEN_INVALID"
    services_only = TRUST.verifier(PLANNER_AUDIENCE, humans=False)
    with pytest.raises(TokenError):
        services_only.verify(mint_dev_token(SECRET, "alice"))


def test_audience_issuer_expiry_and_algorithm_are_checked() -> None:
    assert reason(mint_dev_token(SECRET, "alice", audiences=(TRACKER_AUDIENCE,))) == (
        "WRONG_AUDIENCE"
    )
    assert reason(mint_dev_token(SECRET, "alice", issuer="someone-else")) == "TOKEN_INVALID"
    assert reason(mint_dev_token(SECRET, "alice", ttl_s=-120)) == "TOKEN_EXPIRED"
    assert reason(mint_dev_token(SECRET, "alice", organization_id="")) == "TOKEN_INVALID"
    unsigned = jwt.encode(
        {"sub": "alice", "org": "acme", "iss": DEV_ISSUER, "aud": PLANNER_AUDIENCE, "exp": 2**40},
        None,
        algorithm="none",
    )
    assert reason(unsigned) == "TOKEN_INVALID"
    assert reason("") == "TOKEN_MISSING"
    assert reason("not.a.jwt") == "TOKEN_INVALID"


def test_a_service_token_may_have_no_organization() -> None:
    token = mint_dev_service_token(SECRET, "service:ballet-planner", audiences=(TRACKER_AUDIENCE,))
    claims = TRUST.verifier(TRACKER_AUDIENCE, humans=False).verify(token)
    assert claims.organization_id == "" and claims.is_service


def test_issuers_must_not_share_an_iss_value() -> None:
    keys = KeySet.dev(SECRET)
    with pytest.raises(ValueError, match="different iss"):
        Trust(humans=Issuer(("core",), keys), services=Issuer(("core",), keys, service=True))
    with pytest.raises(ValueError):
        Issuer((), keys)


def test_the_token_command_mints_a_service_principal_only_from_the_service_issuer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    data_dir = ["--data-dir", str(tmp_path)]
    # The first token makes the secret (ballet-planner token --create-secret).
    assert (
        main(["token", "--user", "service:reports", "--scope", READ, "--create-secret", *data_dir])
        == 0
    )
    service_token = capsys.readouterr().out.strip()
    assert main(["token", "--user", "bob", *data_dir]) == 0
    human_token = capsys.readouterr().out.strip()
    verifier = Trust.dev(dev_secret(tmp_path)).verifier(PLANNER_AUDIENCE)
    reader = verifier.verify(service_token)
    assert reader.is_service and reader.scopes == {READ} and reader.organization_id == "acme"
    assert not verifier.verify(human_token).is_service


@pytest.mark.parametrize("ttl_s", [math.inf, math.nan, 1e30, MAX_DEV_TOKEN_TTL_S + 1])
def test_a_dev_token_is_never_minted_for_longer_than_thirty_days(ttl_s: float) -> None:
    """Decision 0168: ``int(now + inf)`` was an OverflowError and 1e30 a token for ever."""
    with pytest.raises(ValueError, match="at most"):
        mint_dev_token(SECRET, "alice", ttl_s=ttl_s)
    with pytest.raises(ValueError, match="at most"):
        mint_dev_service_token(SECRET, "s", audiences=(PLANNER_AUDIENCE,), ttl_s=ttl_s)
    longest = PLANNER.verify(mint_dev_token(SECRET, "alice", ttl_s=MAX_DEV_TOKEN_TTL_S))
    assert longest.expires_at - time.time() <= MAX_DEV_TOKEN_TTL_S


@pytest.mark.parametrize(
    "exp", [10**30, 2**63, 10**400, int(time.time() + MAX_TOKEN_HORIZON_S + 3600)]
)
def test_a_token_expiring_absurdly_far_ahead_is_invalid(exp: int) -> None:
    """A token signed with a trusted key but an ``exp`` no issuer's policy would set (a
    forgery or a mistake) is refused, and 10**400 is not an OverflowError."""
    assert reason(mint_dev_token(SECRET, "alice", claims={"exp": exp})) == "TOKEN_INVALID"
    within = int(time.time() + MAX_TOKEN_HORIZON_S - 3600)
    assert PLANNER.verify(mint_dev_token(SECRET, "alice", claims={"exp": within}))


@pytest.mark.parametrize(("content", "held"), [(b"", "is empty"), (b"abcde\n", "holds 5 bytes")])
def test_a_dev_secret_too_short_for_hs256_is_refused(
    tmp_path: Path, content: bytes, held: str
) -> None:
    (tmp_path / "dev-secret").write_bytes(content)
    (tmp_path / "dev-secret").chmod(0o600)
    with pytest.raises(DevSecretError, match=f"{held}.*delete it") as refused:
        dev_secret(tmp_path)
    assert "\n" not in str(refused.value)
    (tmp_path / "dev-secret").write_bytes(b"\xff" * 32)  # any 32 bytes will do, text or not
    assert dev_secret(tmp_path) == b"\xff" * 32


def test_a_readable_dev_secret_is_warned_about_once_per_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dev_secret(tmp_path)
    (tmp_path / "dev-secret").chmod(0o644)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # serve reads it for the verifier and for its credentials
            dev_secret(tmp_path)
    assert ["readable by other users" in r.getMessage() for r in caplog.records] == [True]
