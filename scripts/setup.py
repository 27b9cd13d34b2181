"""The one install recipe of a checkout: ``scripts/try``, ``scripts/test`` and ``.ci/run``
all set the project's virtualenv up through it (docs/decisions/0320-two-commands.md).

``python3 scripts/setup.py [try|test]`` makes sure the virtualenv exists (``.venv`` of the
checkout, or ``$BALLET_VENV``) and holds, installed editable from this checkout:

- ``try``: the planner (with its chat client) and the devstack;
- ``test``: the same with the planner's ``dev`` extras (pytest, ruff, mypy, ...).

A rerun reuses what is there: the install is recorded in ``<venv>/ballet-setup.json``,
keyed by a hash of both ``pyproject.toml`` files, so it takes well
under a second unless a dependency changed (then pip installs only what changed). The
install is editable, so a change of the code needs no reinstall. Prints the virtualenv's
Python on stdout, progress on stderr; exits 1 with one line when something cannot be set
up. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What each purpose installs (pip requirement specifiers, relative to the checkout).
PURPOSES = {
    "try": ["-e", ".", "-e", "./devstack"],
    "test": ["-e", ".[dev]", "-e", "./devstack"],
}
#: A purpose whose install covers another's.
COVERS = {"test": {"try", "test"}, "try": {"try"}}
STAMP = "ballet-setup.json"
MINIMUM = (3, 11)


class SetupError(RuntimeError):
    """The virtualenv cannot be made or filled; the message says what to do."""


def venv_path() -> Path:
    """The project's virtualenv: ``$BALLET_VENV`` when set, else ``.venv`` of the checkout."""
    chosen = os.environ.get("BALLET_VENV")
    return Path(chosen).absolute() if chosen else ROOT / ".venv"


def key() -> str:
    """What an install depends on: both pyproject files."""
    digest = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", ROOT / "devstack" / "pyproject.toml"):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _say(message: str) -> None:
    print(f"setup: {message}", file=sys.stderr, flush=True)


def _read_stamp(venv: Path) -> dict[str, str]:
    try:
        stamp = json.loads((venv / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def ensure(purpose: str) -> Path:
    """Set the virtualenv up for ``purpose`` (``try`` or ``test``) unless it is already;
    returns its Python. Raises ``SetupError``."""
    if sys.version_info[:2] < MINIMUM:
        raise SetupError(
            f"Python {MINIMUM[0]}.{MINIMUM[1]} or newer is needed; this is "
            f"{sys.version.split()[0]} ({sys.executable})"
        )
    venv = venv_path()
    python = venv / "bin" / "python"
    if not python.exists():
        _say(f"creating the virtualenv {_shown(venv)}")
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True
        )
        if made.returncode != 0:
            said = (made.stderr.strip().splitlines() or [""])[-1]
            raise SetupError(
                f"cannot create {_shown(venv)} ({said}); on Debian or Ubuntu, install "
                "python3-venv first"
            )
    wanted = key()
    stamp = _read_stamp(venv)
    if any(stamp.get(done) == wanted and purpose in COVERS[done] for done in stamp):
        return python
    started = time.monotonic()
    tools = " with the test tools" if purpose == "test" else ""
    _say(
        f"installing the planner and its devstack{tools} into {_shown(venv)} (editable; "
        "once: a rerun takes a second)"
    )
    returncode = _pip(
        [str(python), "-m", "pip", "install", "--quiet", *PURPOSES[purpose]],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"},
    )
    if returncode != 0:
        raise SetupError(f"pip install failed (exit {returncode}); see above")
    stamp[purpose] = wanted
    (venv / STAMP).write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    _say(f"installed in {time.monotonic() - started:.0f} s")
    return python


#: pip's warning for an index location of the machine's pip configuration that does not
#: exist: one per package and location, dozens in a first install, none about this project.
_MISSING_LOCATION = re.compile(r"^WARNING: Location '.*' is ignored: it is neither a file nor")


def _pip(argv: list[str], env: dict[str, str]) -> int:
    """Run pip in the checkout, its output shown as it comes but for the warnings about
    missing index locations, counted in one line instead; returns its exit code."""
    process = subprocess.Popen(
        argv, cwd=ROOT, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    assert process.stderr is not None
    missing = 0
    for line in process.stderr:
        if _MISSING_LOCATION.match(line):
            missing += 1
        else:
            sys.stderr.write(line)
            sys.stderr.flush()
    if missing:
        _say(
            f"left out {missing} warnings of pip about index locations that this machine's "
            "pip configuration names and that do not exist (`pip config list` shows it)"
        )
    return process.wait()


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str]) -> int:
    purpose = argv[0] if argv else "try"
    if purpose not in PURPOSES:
        print(f"usage: scripts/setup.py [{'|'.join(PURPOSES)}]", file=sys.stderr)
        return 2
    try:
        python = ensure(purpose)
    except SetupError as error:
        print(f"setup: {error}", file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
