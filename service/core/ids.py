"""Identifiers and request fingerprints."""

from __future__ import annotations

import hashlib
import uuid


def new_id(prefix: str) -> str:
    """A fresh identifier such as ``turn_3f2a...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def request_hash(*parts: str) -> str:
    """The AIP-155 payload fingerprint of a request."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()
