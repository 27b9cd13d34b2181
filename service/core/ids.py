"""Identifiers and request fingerprints: every id the planner mints is minted here.

Two formats, each kept for what reads it:

- session ids are plain UUIDs (``3f2a9c1e-...``, 36 characters): they are the
  ``sessions/{session}`` part of the API's resource names, which clients store;
- every other id is ``<kind>_<32 hex digits>`` (``turn_3f2a...``), the kind naming what
  it identifies in logs and rows: ``turn``, ``msg`` (a message), ``call`` (a tool call),
  ``gen`` (one model request), ``stream`` (an open Chat stream), ``chat`` (a Chat
  message's request id when the client sent none).
"""

from __future__ import annotations

import hashlib
import uuid


def new_id(kind: str) -> str:
    """A fresh ``<kind>_<32 hex digits>`` identifier such as ``turn_3f2a...``."""
    return f"{kind}_{uuid.uuid4().hex}"


def new_session_id() -> str:
    """A fresh session id: a UUID in its 36-character text form."""
    return str(uuid.uuid4())


def new_turn_id() -> str:
    """A fresh turn id, ``turn_<hex>``."""
    return new_id("turn")


def new_message_id() -> str:
    """A fresh message id, ``msg_<hex>``."""
    return new_id("msg")


def new_call_id() -> str:
    """A fresh id of a tool call the planner makes itself, ``call_<hex>``."""
    return new_id("call")


def new_model_request_id() -> str:
    """A fresh id of one model request, ``gen_<hex>``."""
    return new_id("gen")


def new_stream_id() -> str:
    """A fresh id of an open Chat stream, ``stream_<hex>``."""
    return new_id("stream")


def new_chat_request_id() -> str:
    """A fresh request id for a Chat message sent without one, ``chat_<hex>``."""
    return new_id("chat")


def request_hash(*parts: str) -> str:
    """The AIP-155 payload fingerprint of a request: SHA-256 hex of the parts, each
    NUL-terminated."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()
