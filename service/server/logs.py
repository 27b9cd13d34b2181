"""Structured logs (docs/spec/operations.md): JSON lines or key=value text on stderr.

Context fields ride on the standard ``logging`` calls, either per call
(``log.info("turn ended", extra={"session": s, "turn": t})``) or for a whole task with
``bind(session=..., turn=..., project=..., actor=...)`` (a context variable, so each
asyncio task keeps its own). No human text, assistant text, tool arguments or results,
summary or token is logged at INFO or above; code that logs content checks
``LoggingSettings.content_enabled`` (``log_content = true`` and level DEBUG) and logs it
at DEBUG.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from service.config import LoggingSettings

#: The context fields a record may carry, in output order.
CONTEXT_FIELDS = ("session", "turn", "project", "actor", "replica", "rpc")
_bound: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "ballet_planner_log_fields", default=None
)


@contextmanager
def bind(**fields: str) -> Iterator[None]:
    """Add context fields (``session``, ``turn``, ``project``, ``actor``...) to every
    record logged in this task until the block ends."""
    current = _bound.get() or {}
    token = _bound.set({**current, **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _bound.reset(token)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    values: dict[str, Any] = dict(_bound.get() or {})
    for name in CONTEXT_FIELDS:
        value = record.__dict__.get(name)
        if value not in (None, ""):
            values[name] = value
    return values


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, context fields, error."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...`` for people reading a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).strftime("%H:%M:%S.%f")[:-3]
        context = " ".join(f"{key}={value}" for key, value in _fields(record).items())
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if context:
            line = f"{line} {context}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


#: What grpc.aio logs at ERROR when it cannot send a unary RPC's answer because the
#: client already left (a cancelled or timed-out call): an ordinary cancel, not an alert.
CLIENT_GONE_PREFIX = "ExecuteBatchError raised in core by servicer method"


class ClientGoneFilter(logging.Filter):
    """Logs grpc.aio's "ExecuteBatchError raised in core by servicer method" at DEBUG
    instead of ERROR (decision 0313): it means the client gave up before the answer was
    sent. Dropped unless its logger speaks at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(CLIENT_GONE_PREFIX):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info, record.exc_text = None, None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


#: The logger grpc.aio's server writes its errors to.
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


def quiet_clients_gone() -> None:
    """Install ``ClientGoneFilter`` on grpc.aio's logger (once)."""
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in logger.filters):
        logger.addFilter(ClientGoneFilter())


def configure_logging(settings: LoggingSettings) -> None:
    """Send the root logger's records to stderr in ``settings.format`` at
    ``settings.level``, replacing handlers set before (called once by ``serve``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.level)
    # SQLAlchemy logs statements and their parameters (content) at INFO; the others are
    # chatty. They speak at WARNING unless content logging is on (level DEBUG).
    quiet = logging.DEBUG if settings.content_enabled else logging.WARNING
    for noisy in ("sqlalchemy", "aiosqlite", "asyncio", "grpc", "psycopg"):
        logging.getLogger(noisy).setLevel(max(quiet, root.level))
    quiet_clients_gone()
