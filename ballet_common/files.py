"""Local files that hold transcripts or secrets: owner-only, whatever the umask.

The planner's ``planner.db``, the devstack's ``devstack.db``, the dev token secret and the
page-token key are created ``0600`` in a ``0700`` directory. A process's umask
only ever removes bits, so a umask of ``000`` would leave ``open(..., 0o600)`` alone but a
plain ``mkdir``/``sqlite3.connect`` world-readable; each mode is therefore set with
``fchmod``/``chmod`` after creation, not left to the umask.

SQLite creates its ``-wal``, ``-shm`` and ``-journal`` files with the mode of the database
file (``findCreateFileMode`` in its Unix VFS), so creating the database file ``0600``
before SQLite opens it covers them too.

Existing files and directories are never changed: an operator may have chosen their modes
(a group-readable directory shared with a backup agent, say). ``exposed`` tells whether a
file is open to other users, for a warning.

``check_sqlite_file`` asks SQLite whether an existing database file is one, so that a
damaged ``planner.db`` or ``devstack.db`` is one line at start-up naming the file and what
to do, not a traceback from deep inside the first migration; and whether this process
may write it, so that a read-only one is refused at start, not found by every write.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import stat
from pathlib import Path

#: Owner read and write: files holding transcripts or secrets.
PRIVATE_FILE_MODE = 0o600
#: Owner only: directories that hold such files.
PRIVATE_DIR_MODE = 0o700


def private_directory(path: Path) -> Path:
    """Make sure ``path`` is a directory; one this call creates is ``0700``.

    Missing parents are created too (with the umask's default mode: they hold no secret
    themselves). An existing directory is left as it is. Returns ``path``. Raises
    ``OSError`` (e.g. ``NotADirectoryError``, ``PermissionError``) when it cannot be made.
    """
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise
        return path  # another process made it first; its mode is its choice
    os.chmod(path, PRIVATE_DIR_MODE)
    return path


def create_private_file(path: Path, content: bytes = b"") -> bool:
    """Create ``path`` with mode ``0600`` holding ``content``, unless it already exists.

    The directory is made with ``private_directory``. The content is written and synced
    under a temporary name in the same directory first, then linked to ``path`` with
    ``link(2)``, which is atomic and fails when ``path`` exists. So two processes racing
    to create a secret never both write one, and no process ever reads ``path`` empty or
    half written (two replicas starting together on one data directory did): the loser
    gets False and reads the winner's whole file. Returns True when this call created the
    file. Raises ``OSError`` when it cannot be created.
    """
    directory = private_directory(path.parent)
    if path.exists():
        return False
    temporary = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)
            view = memoryview(content)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
    return True


def exposed(path: Path) -> bool:
    """True when ``path`` is a file its group or other users have any access to."""
    try:
        status = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    return stat.S_ISREG(status.st_mode) and bool(status.st_mode & 0o077)


#: SQLite's result codes for a file that is not a database (``SQLITE_NOTADB``) and for a
#: damaged one (``SQLITE_CORRUPT``); https://sqlite.org/rescode.html.
_NOT_A_DATABASE = frozenset({26, 11})


class DatabaseFileError(ValueError):
    """A SQLite database file is not a database, is damaged or is read-only;
    ``str(error)`` is one line naming the file and what to do."""


def check_sqlite_file(path: Path) -> None:
    """Check that the SQLite file ``path`` holds a database SQLite can read.

    Opens it read-write (never creating it) and reads its schema table, which makes
    SQLite check the file header and the first page; an empty file is a valid empty
    database. Cheap (one page), unlike ``PRAGMA integrity_check``: damage further in
    is found when it is read. Raises ``DatabaseFileError`` when SQLite answers
    ``SQLITE_NOTADB`` or ``SQLITE_CORRUPT``, or when this process may not write the file
    (its mode, or a read-only file system: SQLite would open it read-only and fail every
    write); other failures (a locked or unreadable file) are left to the caller's own
    opening, which reports them.
    """
    if path.exists() and not os.access(path, os.W_OK):
        raise DatabaseFileError(
            f"{path} is read-only for this process (its mode or its file system); make "
            "it writable, or move it away (the next start makes an empty one)"
        )
    uri = f"{path.absolute().as_uri()}?mode=rw"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as connection:
            connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as error:
        if getattr(error, "sqlite_errorcode", None) not in _NOT_A_DATABASE:
            return
        raise DatabaseFileError(
            f"{path} is not a SQLite database or is damaged ({error}); move it away (the "
            "next start makes an empty one) or restore it from a backup"
        ) from error
