"""The planner's own service credential: dev-minted, from a file, or none (mTLS)."""

from __future__ import annotations

import os
from pathlib import Path

import jwt
import pytest

from service.credentials import ServiceCredential
from service.tokens import PLANNER_SERVICE_SUBJECT, TRACKER_AUDIENCE

SECRET = b"0123456789abcdef0123456789abcdef"


def test_dev_credential_is_the_planner_for_every_backend() -> None:
    credential = ServiceCredential(dev_secret=SECRET)
    token = credential.token()
    claims = jwt.decode(token, SECRET, algorithms=["HS256"], audience=TRACKER_AUDIENCE)
    assert claims["sub"] == PLANNER_SERVICE_SUBJECT
    assert credential.token() == token  # reused until close to expiry


def test_token_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    credential = ServiceCredential(token_file=path)
    assert credential.token() == "first"
    path.write_text("second\n")
    stat = path.stat()
    os.utime(path, (stat.st_atime, stat.st_mtime + 10))
    assert credential.token() == "second"
    path.write_text("")
    os.utime(path, (stat.st_atime, stat.st_mtime + 20))
    with pytest.raises(ValueError):
        credential.token()


def test_no_credential_means_the_mtls_identity() -> None:
    assert ServiceCredential().token() == ""
    with pytest.raises(ValueError):
        ServiceCredential(token_file=Path("t"), dev_secret=SECRET)
