"""The one error of the devstack's importers: an input file that cannot be imported.

A new user's first import is often a file that is not what it should be (the wrong
file, a hand-edited line, another encoding). Each way becomes one ``ImportFileError``
line that says which import failed, names the file and, where there is one, the line,
and what is wrong, never a traceback or a bare decoder message.
"""

from __future__ import annotations

from pathlib import Path


class ImportFileError(ValueError):
    """An input file of the ``importer`` import (``tracker``, ``knowledge``, ``skills``)
    cannot be imported. ``str(error)`` is one line:
    ``the tracker import failed: issues.jsonl, line 2: not valid JSON (...)``.

    A ``ValueError``, so that ``DevStack.start`` callers that handle bad input handle it.
    """

    def __init__(self, importer: str, path: Path, problem: str, line: int | None = None) -> None:
        where = f"{path}, line {line}" if line is not None else str(path)
        super().__init__(f"the {importer} import failed: {where}: {problem}")
        self.importer = importer
        self.path = path
        self.line = line


def read_text(importer: str, path: Path) -> str:
    """The UTF-8 text of ``path``; raises ``ImportFileError`` naming the line of the first
    byte that is not UTF-8, or what the OS said when the file cannot be read."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise unreadable(importer, path, error) from None
    return decode(importer, path, raw)


def decode(importer: str, path: Path, raw: bytes, first_line: int = 1) -> str:
    """``raw`` (bytes of ``path`` starting at line ``first_line``) as UTF-8 text; raises
    ``ImportFileError`` naming the line of the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + raw.count(b"\n", 0, error.start)
        raise ImportFileError(importer, path, "not UTF-8 text", line) from None


def unreadable(importer: str, path: Path, error: OSError) -> ImportFileError:
    """The ``ImportFileError`` for ``error``, raised while reading ``path``."""
    reason = (error.strerror or str(error)).lower()
    return ImportFileError(importer, path, f"cannot read it ({reason})")
