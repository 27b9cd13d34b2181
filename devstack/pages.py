"""AIP-158 pagination helpers: page sizes and opaque, tamper-proof page tokens.

The tokens are the planner's own (``ballet_common.pages``, decision 0152): bound to the
list's name, the request's filters and the position, so a token edited by a client, or
replayed with other filters, is refused with ``INVALID_ARGUMENT``/``INVALID_PAGE_TOKEN``
as AIP-158 requires. The key is derived from the dev secret, so tokens stay valid across a
restart of the same data directory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from ballet_common import pages
from devstack.errors import InvalidArgument


def page_size(requested: int, *, default: int, maximum: int) -> int:
    """The effective page size: ``default`` for 0, at most ``maximum`` (AIP-158 coerces).

    Raises ``InvalidArgument`` (INVALID_PAGE_SIZE) for a negative size.
    """
    if requested < 0:
        raise InvalidArgument("INVALID_PAGE_SIZE", "page_size must not be negative")
    if requested == 0:
        return default
    return min(requested, maximum)


class PageTokens(pages.PageTokens):
    """The shared ``ballet_common.pages.PageTokens`` under one key derived from ``key``
    (the dev secret), refusing with ``InvalidArgument`` (INVALID_PAGE_TOKEN)."""

    def __init__(self, key: bytes) -> None:
        derived = hashlib.sha256(b"devstack page tokens\0" + key).digest()
        super().__init__(lambda: (derived,), _invalid_token)

    def decode_page(
        self, token: str, listing: str, filters: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The position in ``token``, or None for an empty token (the first page).

        Raises ``InvalidArgument`` (INVALID_PAGE_TOKEN) when the token was not issued for
        this listing and these filters, or was altered.
        """
        return self.decode(token, listing, filters) if token else None


def _invalid_token() -> InvalidArgument:
    return InvalidArgument(
        "INVALID_PAGE_TOKEN", "the page token is invalid or belongs to another request"
    )
