"""Provider error text made safe to log, store, send over the gateway or show.

A model provider's error body is text we do not control: a 401 from some servers echoes
the API key it was sent, a proxy may quote the ``Authorization`` header, and a body can be
megabytes of HTML. ``scrub`` cuts such text to a few hundred characters on one line and
replaces whatever looks like a credential with ``[REDACTED]``:

- ``Authorization: ...`` and ``Proxy-Authorization: ...`` header values (to the end of
  the line or the quoted string);
- ``Bearer <token>`` and ``Basic <token>`` anywhere;
- secret-key shapes: ``sk-...`` (OpenAI, Anthropic, DeepSeek and many compatible
  servers), ``AKIA...`` (AWS), ``ghp_``/``github_pat_`` (GitHub), ``xox?-`` (Slack),
  ``AIza...`` (Google), and JSON Web Tokens (``eyJ...``);
- ``name=value`` and ``"name": "value"`` pairs whose name says key, token, secret or
  password (``api_key``, ``x-api-key``, ``access_token``, ``client_secret``, ...).

The planner and the devstack gateway both apply it (defence in depth): the gateway before
an error leaves it, the planner's gateway client before a message is raised, logged or
stored. It over-redacts rather than under-redacts: a false positive costs a word of an
error message, a false negative leaks a credential.
"""

from __future__ import annotations

import re

#: How many characters of provider text survive ``scrub`` by default.
MAX_CHARS = 300
#: Marks what was removed.
REDACTED = "[REDACTED]"

# Scrubbing reads at most this much: a secret past it cannot reach the output, which is
# cut far shorter, and a multi-megabyte HTML error page costs no more than this.
_SCAN_CHARS = 16 * 1024

_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization|x-api-key|api-key|cookie|set-cookie)"
    r"(\s*[:=]\s*)(\"[^\"]*\"|'[^']*'|[^\r\n,;}]*)"
)
_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)([A-Za-z0-9._~+/=\-]{4,})")
_NAMED = re.compile(
    r"(?i)([\"']?)\b([a-z0-9_\-]*(?:api[_\-]?key|apikey|secret|password|passwd|"
    r"access[_\-]?token|refresh[_\-]?token|auth[_\-]?token|session[_\-]?token|"
    r"private[_\-]?key|credential)s?)\1(\s*[:=]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&}\"']+)"
)
_SHAPES = re.compile(
    r"\b(?:"
    r"sk-[A-Za-z0-9_\-*.]{6,}"
    r"|AKIA[0-9A-Z]{16}"
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"
    r"|AIza[0-9A-Za-z_\-]{30,}"
    r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"
    r")"
)
_SPACE = re.compile(r"\s+")


def redact(text: str) -> str:
    """``text`` with every credential-looking part replaced by ``[REDACTED]``; nothing is
    cut or reflowed (see the module docstring for what is matched)."""
    text = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _SCHEME.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _NAMED.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{REDACTED}", text)
    return _SHAPES.sub(REDACTED, text)


def scrub(text: str, max_chars: int = MAX_CHARS) -> str:
    """Provider text fit for a log line, a stored turn, a status message or a human.

    Redacts credentials (``redact``), joins the text onto one line (runs of whitespace
    become one space) and cuts it to ``max_chars`` characters, ending with "…" when cut.
    Redaction runs before the cut, so a key cannot survive by being cut in half.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    head = text[:_SCAN_CHARS]
    clean = _SPACE.sub(" ", redact(head)).strip()
    if len(clean) <= max_chars and len(text) <= _SCAN_CHARS:
        return clean
    return clean[: max_chars - 1].rstrip() + "…"
