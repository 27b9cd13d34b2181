"""AIP-158 pagination helpers: page sizes and opaque, tamper-proof page tokens.

A token is ``base64url(json(position) + HMAC-SHA256 tag)``. The tag covers the list's
name, a digest of the request's filters and the position, so a token edited by a client,
or replayed with other filters, is refused with ``INVALID_ARGUMENT``/``INVALID_PAGE_TOKEN``
as AIP-158 requires. The key is derived from the dev secret, so tokens stay valid across a
restart of the same data directory.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from devstack.errors import InvalidArgument

_TAG_BYTES = 16


def page_size(requested: int, *, default: int, maximum: int) -> int:
    """The effective page size: ``default`` for 0, at most ``maximum`` (AIP-158 coerces).

    Raises ``InvalidArgument`` (INVALID_PAGE_SIZE) for a negative size.
    """
    if requested < 0:
        raise InvalidArgument("INVALID_PAGE_SIZE", "page_size must not be negative")
    if requested == 0:
        return default
    return min(requested, maximum)


class PageTokens:
    """Signs and checks page tokens with one key."""

    def __init__(self, key: bytes) -> None:
        self._key = hashlib.sha256(b"devstack page tokens\0" + key).digest()

    def encode(self, listing: str, filters: Mapping[str, Any], position: Mapping[str, Any]) -> str:
        """A token for ``position`` (JSON-serializable) in ``listing`` under ``filters``."""
        body = json.dumps(dict(position), separators=(",", ":"), sort_keys=True).encode()
        tag = self._tag(listing, filters, body)
        return base64.urlsafe_b64encode(body + tag).decode().rstrip("=")

    def decode(self, token: str, listing: str, filters: Mapping[str, Any]) -> dict[str, Any] | None:
        """The position in ``token``, or None for an empty token (the first page).

        Raises ``InvalidArgument`` (INVALID_PAGE_TOKEN) when the token was not issued for
        this listing and these filters, or was altered.
        """
        if not token:
            return None
        invalid = InvalidArgument(
            "INVALID_PAGE_TOKEN", "the page token is invalid or belongs to another request"
        )
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            raise invalid from None
        body, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        if len(raw) <= _TAG_BYTES or not hmac.compare_digest(
            tag, self._tag(listing, filters, body)
        ):
            raise invalid
        position = json.loads(body)
        if not isinstance(position, dict):
            raise invalid
        return position

    def _tag(self, listing: str, filters: Mapping[str, Any], body: bytes) -> bytes:
        scope = json.dumps([listing, dict(filters)], separators=(",", ":"), sort_keys=True)
        mac = hmac.new(self._key, scope.encode() + b"\0" + body, hashlib.sha256)
        return mac.digest()[:_TAG_BYTES]
