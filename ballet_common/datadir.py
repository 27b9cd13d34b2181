"""The data directory (``data_dir``): the dev token secret and the SQLite database live
there (docs/spec/authority.md and docs/spec/storage.md). A new user's first problem is often this
folder, so every way it can be unusable becomes one ``DataDirError`` line that names the folder,
says what is wrong and how to choose another, never a traceback."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from ballet_common.files import private_directory

#: The data directory of ``dev``, ``serve`` (its default), ``token`` and ``chat``.
DEFAULT_DATA_DIR = Path(".ballet-dev")

#: What to do, for commands configured by settings; commands with ``--data-dir`` say so.
HOW_TO_CHOOSE = "set data_dir (BALLET_PLANNER__DATA_DIR) to a writable folder"
WITH_OPTION = "give --data-dir a writable folder"


class DataDirError(RuntimeError):
    """The data directory cannot be used; ``str(error)`` is one line for the human."""


def describe(path: Path, error: OSError) -> str:
    """``error`` (from using ``path``) as a short phrase: the OS's words, no errno."""
    reason = error.strerror or str(error)
    where = Path(error.filename) if error.filename else path
    return f"{where}: {reason.lower()}" if where != path else reason.lower()


def prepare(path: Path, how: str = HOW_TO_CHOOSE) -> Path:
    """Create ``path`` (and its parents) if needed and check it is a writable directory;
    ``how`` ends the error message (what to do instead).

    Returns ``path``. Raises ``DataDirError``: the path or a parent is a file, it cannot
    be created, or it is not writable.
    """
    try:
        # Owner-only, whatever the umask: it holds transcripts and secrets.
        private_directory(path)
    except (FileExistsError, NotADirectoryError):
        raise DataDirError(
            f"data directory {path} is a file, not a folder; {how}"
        ) from None
    except OSError as error:
        raise DataDirError(
            f"data directory {path} cannot be created ({describe(path, error)}); "
            f"{how}"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise DataDirError(f"data directory {path} is not writable; {how}")
    return path


def check_folder(path: Path, how: str = HOW_TO_CHOOSE) -> Path:
    """Check, without creating anything, that ``path`` is a writable folder or could be
    made as one (its nearest existing ancestor is a writable folder). Returns ``path``;
    raises ``DataDirError`` naming the problem."""
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is inside {existing}, a file"
        raise DataDirError(f"data directory {path} {what}, not a folder; {how}")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" (in {existing})"
        raise DataDirError(f"data directory {path} is not writable{where}; {how}")
    return path


def unusable(
    path: Path, error: OSError, doing: str, how: str = HOW_TO_CHOOSE
) -> DataDirError:
    """The ``DataDirError`` for ``error``, raised while ``doing`` something in ``path``."""
    return DataDirError(
        f"data directory {path}: cannot {doing} ({describe(path, error)}); {how}"
    )


def chosen(explicit: Path | None, environ: dict[str, str] | None = None) -> Path:
    """The data directory a command uses: ``explicit`` (its ``--data-dir``), else
    ``$BALLET_PLANNER__DATA_DIR``, else ``./.ballet-dev``."""
    if explicit is not None:
        return explicit
    env = os.environ if environ is None else environ
    return Path(env.get("BALLET_PLANNER__DATA_DIR", "") or DEFAULT_DATA_DIR)


#: The file a ``dev``, or a ``serve`` on SQLite, holds locked in its data directory
#: (decisions 0274 and 0229): its SQLite files and secrets are for one process.
LOCK_FILE = "planner.lock"
_HELD: list[IO[str]] = []


def hold(data_dir: Path, command: str) -> IO[str] | str | None:
    """Lock ``data_dir`` for this process (``ballet-planner COMMAND``, ``dev`` or
    ``serve``) for its life. Returns the open lock file (kept open), None when the folder
    does not exist yet (the start creates it) or cannot be opened (the start reports
    that), or the one line that says which command and pid hold it. Idempotent within a
    process (flock locks conflict across descriptors): the first command named keeps it.
    """
    if _HELD:
        return _HELD[0]
    if not data_dir.is_dir():
        return None
    path = data_dir / LOCK_FILE
    try:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held until exit
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        pid, _, holder = handle.read().strip().partition(" ")
        handle.close()
        by = f" (pid {pid})" if pid.isdigit() else ""
        return (
            f"{data_dir.absolute()} is in use by another `ballet-planner {holder or 'dev'}`"
            f"{by}; stop it, or give this one its own --data-dir"
        )
    os.chmod(path, 0o600)
    handle.truncate(0)
    handle.write(f"{os.getpid()} {command}")
    handle.flush()
    _HELD.append(handle)
    return handle
