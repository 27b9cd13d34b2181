"""The 16 KiB cut of tool results (docs/spec/turn-loop.md step 5): a result over the limit is
cut and stays valid JSON, ``{"truncated": true, "original_bytes": N, "content": ...}``.

Tool-call arguments over their own bound are cut the same way (``cut_text``), and so is
any JSON field of a message sent to a client cut (decision 0221).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

#: The largest tool result given to the model, in UTF-8 bytes (docs/spec/turn-loop.md step 5).
MAX_RESULT_BYTES = 16 * 1024
#: The largest tool-call arguments run and stored whole, in UTF-8 bytes (decision 0221):
#: about the largest JSON the tools' schemas accept (``propose_changeset``: 50 operations
#: of some 40,000 characters), so no call a schema would take is refused for its size.
MAX_ARGUMENT_BYTES = 2 * 1024 * 1024


def dumps(value: Any) -> str:
    """Compact JSON in UTF-8 (not ``\\u`` escapes): the model pays for every byte. NaN and
    infinities are refused (``ValueError``): they are not JSON."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _size(text: str) -> int:
    return len(text.encode())


def cut_to_fit(output: Any, max_bytes: int = MAX_RESULT_BYTES) -> str:
    """Serialize ``output`` as compact JSON of at most ``max_bytes`` UTF-8 bytes.

    A result that fits is returned as is. A larger one becomes
    ``{"truncated": true, "original_bytes": N, "content": ...}`` (docs/spec/turn-loop.md step 5),
    where ``N`` is the full size in bytes and ``content`` keeps the result's shape with:

    - for a result holding a list (a top-level array, or the largest array member of a
      top-level object): as many whole leading list items as fit. ``next_page_token`` is
      dropped, since it would skip the items cut (ask for a smaller page instead);
    - otherwise: the longest strings shortened to as many characters as fit;
    - failing both: the first characters of the JSON text, as a string.

    Raises ``TypeError``/``ValueError`` when ``output`` is not JSON-serializable.
    """
    text = dumps(output)
    original = _size(text)
    if original <= max_bytes:
        return text

    def wrapped(content: Any) -> str:
        return dumps({"truncated": True, "original_bytes": original, "content": content})

    shortened = _cut_list(output, max_bytes, wrapped)
    if shortened is not None:
        return shortened
    shortened = _cut_strings(output, max_bytes, wrapped)
    if shortened is not None:
        return shortened
    return _cut_text(text, max_bytes, wrapped)


def _cut_list(output: Any, max_bytes: int, wrapped: Callable[[Any], str]) -> str | None:
    if isinstance(output, list):
        items: list[Any] = output

        def rebuild(kept: list[Any]) -> Any:
            return kept

    elif isinstance(output, dict):
        lists = [key for key, value in output.items() if isinstance(value, list) and value]
        if not lists:
            return None
        sizes = {name: _size(dumps(output[name])) for name in lists}
        key = max(lists, key=sizes.__getitem__)
        # A list that is not the bulk of the result (an item's dependency ids next to a
        # long description) is not what made it too large; shorten the strings instead.
        if sizes[key] * 2 < _size(dumps(output)):
            return None
        items = output[key]
        rest = {name: value for name, value in output.items() if name != "next_page_token"}

        def rebuild(kept: list[Any]) -> Any:
            return {**rest, key: kept}

    else:
        return None
    # Each kept item adds its own size plus a comma, so a running sum finds the count
    # without serializing the result once per candidate.
    base = _size(wrapped(rebuild([])))
    if base > max_bytes:
        return None
    budget = max_bytes - base
    count = 0
    used = 0
    for item in items:
        cost = _size(dumps(item)) + (1 if count else 0)
        if used + cost > budget:
            break
        used += cost
        count += 1
    text = wrapped(rebuild(items[:count]))
    return text if _size(text) <= max_bytes else None


def _cut_strings(output: Any, max_bytes: int, wrapped: Callable[[Any], str]) -> str | None:
    if isinstance(output, str):
        base = _size(wrapped(""))
        return wrapped(_prefix_fitting(output, max_bytes - base)) if base <= max_bytes else None
    if not isinstance(output, dict | list):
        return None
    # Shorten the longest string, then the next, until the result fits: the big field
    # (a description, a SKILL.md, a body) goes first and the ids stay whole.
    content = json.loads(dumps(output))  # a private copy to shorten in place
    for _ in range(32):
        found = _longest_string(content)
        if found is None:
            return None
        parent, key, value = found
        parent[key] = ""
        base = _size(wrapped(content))
        if base > max_bytes:
            continue
        parent[key] = _prefix_fitting(value, max_bytes - base)
        return wrapped(content)
    return None


def _longest_string(value: Any) -> tuple[Any, Any, str] | None:
    best: tuple[Any, Any, str] | None = None
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        pairs: Any = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in pairs:
            if isinstance(child, str):
                if child and (best is None or len(child) > len(best[2])):
                    best = (node, key, child)
            elif isinstance(child, dict | list):
                stack.append(child)
    return best


def _prefix_fitting(value: str, budget: int) -> str:
    """The longest prefix of ``value`` whose JSON string form adds at most ``budget``
    bytes to an empty string's (escapes counted)."""
    # Every character takes at least one byte, so no prefix longer than the budget fits.
    low, high = 0, min(len(value), max(budget, 0))
    while low < high:
        middle = (low + high + 1) // 2
        if _size(dumps(value[:middle])) - 2 <= budget:
            low = middle
        else:
            high = middle - 1
    return value[:low]


def _cut_text(text: str, max_bytes: int, wrapped: Callable[[Any], str]) -> str:
    base = _size(wrapped(""))
    return wrapped(_prefix_fitting(text, max(0, max_bytes - base)))


def utf8_size(text: str, limit: int) -> int | None:
    """``text``'s size in UTF-8 bytes when it is over ``limit``, else None; a text of at
    most ``limit // 4`` characters is known to fit without being encoded."""
    if len(text) <= limit // 4:
        return None
    size = len(text.encode())
    return size if size > limit else None


def cut_text(text: str, max_bytes: int, original_bytes: int | None = None) -> str:
    """``text`` (any text: JSON, possibly invalid, or prose) as the valid JSON
    ``{"truncated": true, "original_bytes": N, "content": "<its first characters>"}`` of
    at most ``max_bytes`` UTF-8 bytes (for a ``max_bytes`` of at least 64), where ``N`` is
    the text's full size in UTF-8 bytes (given as ``original_bytes`` when known).

    The content is the start of the text as a JSON string, not a parse of it: the text
    may not be JSON, and its start is what a reader (the model, a client) needs to see
    what it was.
    """
    original = len(text.encode()) if original_bytes is None else original_bytes

    def wrapped(content: str) -> str:
        return dumps({"truncated": True, "original_bytes": original, "content": content})

    # Every character takes at least one byte: only the first ``budget`` can fit, so the
    # search looks at that window of the text, however long the text is.
    budget = max(0, max_bytes - _size(wrapped("")))
    return wrapped(_prefix_fitting(text[:budget], budget))
