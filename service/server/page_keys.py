"""The keys that authenticate page tokens (docs/decisions/0152-authenticated-page-tokens.md).

A key file holds one key per line, newest first; empty lines and lines starting with
``#`` are skipped. The first key signs new page tokens, every key verifies, so rotating
is: add the new key as a second line on every replica, then move it first, then, once
the old tokens may go (clients restart a listing from its first page), remove the old
line. The file is re-read when its modification time changes; a file that cannot be
used keeps the last good keys, with a WARNING.

Production reads ``auth.page_token_key_file`` (a Secret; every replica the same). Dev
mode generates ``page-token-key`` in the data directory at first run, ``0600`` in a
``0700`` directory, like the dev secret.
"""

from __future__ import annotations

import logging
import secrets
import threading
from pathlib import Path

from ballet_common.files import create_private_file, exposed

log = logging.getLogger(__name__)

DEV_PAGE_KEY_FILE = "page-token-key"
#: Shortest key accepted, in characters (a 32-character key of hex digits is 128 bits).
MIN_KEY_CHARS = 32


class PageTokenKeys:
    """The keys of a key file, newest first; call it for the current list."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._keys: list[bytes] = []
        self._mtime: float | None = None
        self._lock = threading.Lock()

    @classmethod
    def dev(cls, data_dir: Path) -> PageTokenKeys:
        """The dev key file of ``data_dir``, generated (``0600``) on first use."""
        path = data_dir / DEV_PAGE_KEY_FILE
        create_private_file(path, (secrets.token_hex(32) + "\n").encode())
        return cls.load(path)

    @classmethod
    def load(cls, path: Path) -> PageTokenKeys:
        """The keys of ``path``, read now. Raises ``OSError`` or ``ValueError`` (no key,
        or one shorter than ``MIN_KEY_CHARS``)."""
        keys = cls(path)
        keys._reload()
        if exposed(path):
            log.warning(
                "the page token key file %s is readable by other users: anyone who reads "
                "it can forge page tokens; run chmod 600 on it",
                path,
            )
        return keys

    def __call__(self) -> list[bytes]:
        try:
            self._reload()
        except (OSError, ValueError) as error:
            log.warning("page token keys: keeping the last good keys: %s", error)
        return self._keys

    def _reload(self) -> None:
        mtime = self._path.stat().st_mtime
        if mtime == self._mtime:
            return
        with self._lock:
            lines = self._path.read_text().splitlines()
            keys = [line.strip() for line in lines]
            keys = [key for key in keys if key and not key.startswith("#")]
            if not keys:
                raise ValueError(f"{self._path}: no page token key")
            if any(len(key) < MIN_KEY_CHARS for key in keys):
                raise ValueError(
                    f"{self._path}: every page token key needs at least {MIN_KEY_CHARS} characters"
                )
            self._keys = [key.encode() for key in keys]
            self._mtime = mtime
