"""Page tokens of the planner's lists (AIP-158; decision 0152): the shared
``ballet_common.pages.PageTokens``, refusing a bad token the planner's way.

Authorization still never rests on the token (every page re-applies the caller's
filters); the MAC makes a position something only the service wrote, and the callers
still bounds-check it before it reaches the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ballet_common import pages
from service.core.errors import InvalidArgument


def bad_page_token() -> InvalidArgument:
    """The one refusal of a token: ``InvalidArgument``/``INVALID_PAGE_TOKEN``."""
    return InvalidArgument(
        "the page token is invalid, or belongs to another query", reason="INVALID_PAGE_TOKEN"
    )


class PageTokens(pages.PageTokens):
    """``ballet_common.pages.PageTokens`` over ``keys`` (newest first), raising
    ``bad_page_token()`` for a token it did not make for this list and query."""

    def __init__(self, keys: Callable[[], Sequence[bytes]]) -> None:
        super().__init__(keys, bad_page_token)
