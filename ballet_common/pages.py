"""Page tokens: opaque, authenticated, bound to their query, bounded (AIP-158).

The one implementation the planner (``service.core.pages``) and the devstack
(``devstack.pages``) both use; docs/decisions/0152-authenticated-page-tokens.md.
A token is base64url (no padding) of compact JSON ``{"v": 2, "p": position, "m": mac}``:
``position`` is where the next page starts, and ``mac`` the first 128 bits of
HMAC-SHA256, under a key only the service holds, over the list kind, the query the first
page was asked with (everything but ``page_size``) and the position. So a token can be
neither forged nor edited, nor moved to another list, caller or query. Keys rotate: the
first key signs, every key of the current set verifies.

Authorization never rests on the token (every page re-applies the caller's filters); the
MAC makes a position something only the service wrote, and callers still bounds-check it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: The token format's version; tokens of another version are refused.
VERSION = 2
#: Longest token decoded at all (characters); the services' own are about 200.
MAX_TOKEN_CHARS = 1024
_MAC_BYTES = 16


class InvalidPageToken(ValueError):
    """A token this service did not make for this list and query (the default refusal)."""


class PageTokens:
    """Encodes and checks page tokens.

    ``keys`` returns the current keys, newest first (at least one; each at least 16
    bytes): the first signs new tokens, all verify, so a key being rotated out keeps
    working until it leaves the set. It is called per token, so a re-read key file takes
    effect at once. ``refuse`` makes the exception a bad token raises (each program's own
    ``INVALID_ARGUMENT``/``INVALID_PAGE_TOKEN``; ``InvalidPageToken`` by default).
    """

    def __init__(
        self,
        keys: Callable[[], Sequence[bytes]],
        refuse: Callable[[], Exception] = InvalidPageToken,
    ) -> None:
        self._keys = keys
        self._refuse = refuse

    @staticmethod
    def _mac(key: bytes, kind: str, query: Mapping[str, Any], position: Any) -> str:
        material = json.dumps([kind, query, position], sort_keys=True, separators=(",", ":"))
        digest = hmac.new(key, material.encode(), hashlib.sha256).digest()[:_MAC_BYTES]
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def encode(self, kind: str, query: Mapping[str, Any], position: Mapping[str, Any]) -> str:
        """The token for the page starting at ``position`` (JSON values) of list ``kind``,
        whose first page was asked with ``query`` (JSON values). Raises ``ValueError``
        when there is no key."""
        keys = self._keys()
        if not keys:
            raise ValueError("no page token key")
        body = {"v": VERSION, "p": dict(position), "m": self._mac(keys[0], kind, query, position)}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    def decode(self, token: str, kind: str, query: Mapping[str, Any]) -> dict[str, Any]:
        """The position in ``token``, if this service made it for this ``kind`` and
        ``query``; raises ``refuse()`` otherwise (malformed, too long, another version,
        edited, forged, or made for another list, caller or query). The caller
        bounds-checks the position's values."""
        if len(token) > MAX_TOKEN_CHARS:
            raise self._refuse()
        try:
            padded = token + "=" * (-len(token) % 4)
            body = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")).decode())
        except (binascii.Error, UnicodeError, ValueError, RecursionError):
            raise self._refuse() from None
        if not isinstance(body, dict) or body.get("v") != VERSION:
            raise self._refuse()
        position, mac = body.get("p"), body.get("m")
        if not isinstance(position, dict) or not isinstance(mac, str):
            raise self._refuse()
        # Bytes, not str: compare_digest refuses non-ASCII text, which a forger may send.
        given = mac.encode()
        for key in self._keys():
            if hmac.compare_digest(given, self._mac(key, kind, query, position).encode()):
                return position
        raise self._refuse()
