"""docs/architecture.md is the map of the repository, and the map is checked (decision 0331).

Read the way the boundary test reads imports (``test_package_boundaries.py``): every
backticked path in the map (a token ending in ``.py`` or ``/``) must exist, and every
module under ``service/``, every top-level folder and every folder of ``tests/`` must be
named in it. A path is read relative to where it is written:

- under a heading ``## service/core: ...`` relative to ``service/core/`` (a heading naming
  several, ``## service/server, service/config, service/cli.py``, relative to their
  common parent ``service/``), else to the repository;
- in a table row's first cell relative to the section; in its other cells also relative
  to each package (``turn/``) the first cell names;
- in a bullet also relative to the folder the bullet names first (``ballet_chat/``);
- and relative to the repository when it has several parts (``docs/spec/``).

A package's ``__init__.py`` is named by its folder; the Alembic folder
(``service/adapters/store/migrations/``) is named as one.

Adding a module, a top-level folder or a test folder: add it to the map's row of its
package (or a new row). Renaming one: rename it in the map too.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[2]
MAP = "docs/architecture.md"
#: Folders taken whole: their contents are another tool's (Alembic's revisions).
WHOLE = ("service/adapters/store/migrations/",)
#: Never part of the map: caches, virtual environments, build output.
IGNORED = {"__pycache__", "node_modules", "build", "dist"}

_TOKEN = re.compile(r"`([A-Za-z0-9_.][A-Za-z0-9_./-]*(?:\.py|/))`")


@dataclass(frozen=True)
class Named:
    """A path the map names: ``token`` as written on ``line``, read relative to each of
    ``bases`` (repository-relative folders, "" for the repository)."""

    token: str
    line: int
    bases: tuple[str, ...]

    def candidates(self) -> list[str]:
        return [base + self.token for base in self.bases]


def _section_base(heading: str) -> str:
    """``service/core: the planner`` -> ``service/core/``; several -> their common folder."""
    head = heading.split(":", 1)[0]
    named = [p.strip() for p in head.split(",") if p.strip().startswith("service")]
    if not named:
        return ""
    folders = [str(PurePosixPath(p).parent) if p.endswith(".py") else p.rstrip("/") for p in named]
    return posixpath.commonpath(folders) + "/"


def named_paths(text: str) -> list[Named]:
    """Every path ``text`` (the map) names, with the folders it is read against."""
    found: list[Named] = []
    base = ""
    bullet_owner: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            base = _section_base(line.lstrip("#").strip()) if line.startswith("## ") else ""
            bullet_owner = ()
            continue
        tokens = _TOKEN.findall(line)
        if line.startswith("|"):
            bullet_owner = ()
            cells = line.strip().strip("|").split("|")
            first = _TOKEN.findall(cells[0])
            packages = tuple(base + t for t in first if t.endswith("/"))
            for token in first:
                found.append(Named(token, number, _bases(token, base)))
            for cell in cells[1:]:
                for token in _TOKEN.findall(cell):
                    found.append(Named(token, number, _bases(token, base, packages)))
            continue
        if line.startswith("- "):
            bullet_owner = ()
            if tokens and tokens[0].endswith("/"):
                bullet_owner = (base + tokens[0],)
        elif not line.startswith("  "):
            bullet_owner = ()
        for token in tokens:
            found.append(Named(token, number, _bases(token, base, bullet_owner)))
    return found


def _bases(token: str, base: str, owners: Iterable[str] = ()) -> tuple[str, ...]:
    """The folders ``token`` is read against: its row's or bullet's ``owners``, the
    section's ``base``, and the repository when the token is a path of several parts
    (``docs/spec/``; ``fanout.py`` under a service heading is the section's alone)."""
    bases = [*owners, base]
    if "/" in token.rstrip("/"):
        bases.append("")
    return tuple(dict.fromkeys(bases))


def repository_paths(root: Path = REPO) -> set[str]:
    """Every file and folder of the repository the map may name, repository-relative,
    folders ending in ``/`` (hidden ones, caches and build output left out)."""
    paths: set[str] = set()
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in IGNORED or p.endswith(".egg-info") for p in parts):
            continue
        relative = "/".join(parts)
        paths.add(relative + "/" if path.is_dir() else relative)
    return paths


def must_be_named(paths: set[str]) -> list[str]:
    """What the map must name: every module under ``service/``, every top-level folder
    and every folder directly under ``tests/`` holding Python files."""
    needed = {p for p in paths if p.endswith("/") and p.count("/") == 1}
    needed |= {
        p
        for p in paths
        if p.startswith("tests/")
        and p.endswith("/")
        and p.count("/") == 2
        and any(q.startswith(p) and q.endswith(".py") for q in paths)
    }
    needed |= {p for p in paths if p.startswith("service/") and p.endswith(".py")}
    return sorted(needed)


def problems(text: str, paths: set[str]) -> list[str]:
    """What is wrong with the map ``text`` over the repository's ``paths``: paths it
    names that do not exist, and paths it must name that it does not."""
    wrong: list[str] = []
    covered: set[str] = set()
    for named in named_paths(text):
        existing = [c for c in named.candidates() if c in paths]
        if not existing:
            wrong.append(f"{MAP}:{named.line} names `{named.token}`, which does not exist")
        covered.update(existing)
    for path in must_be_named(paths):
        if path in covered:
            continue
        if path.endswith("/__init__.py") and path[: -len("__init__.py")] in covered:
            continue
        if any(path.startswith(whole) and whole in covered for whole in WHOLE):
            continue
        wrong.append(f"{MAP} does not name `{path}`")
    return wrong


def test_the_map_names_every_module_and_only_paths_that_exist() -> None:
    text = (REPO / MAP).read_text()
    assert problems(text, repository_paths()) == []


def test_a_renamed_module_the_map_still_names_fails() -> None:
    text = (REPO / MAP).read_text()
    paths = repository_paths()
    assert "service/core/fanout.py" in paths
    renamed = (paths - {"service/core/fanout.py"}) | {"service/core/hub.py"}
    found = problems(text, renamed)
    assert any("names `fanout.py`, which does not exist" in p for p in found), found
    assert f"{MAP} does not name `service/core/hub.py`" in found


def test_a_new_test_folder_or_top_level_folder_must_be_named() -> None:
    text = (REPO / MAP).read_text()
    paths = repository_paths() | {"tests/newkind/", "tests/newkind/test_x.py", "tools/"}
    found = problems(text, paths)
    assert f"{MAP} does not name `tests/newkind/`" in found
    assert f"{MAP} does not name `tools/`" in found


def test_paths_are_read_relative_to_their_section_row_and_bullet() -> None:
    text = "\n".join(
        [
            "## service/core: the core",
            "| module | owns |",
            "|---|---|",
            "| `turn/` | `loop.py` (the loop) |",
            "## service/server, service/config, service/cli.py: the process",
            "| `server/root.py` | root |",
            "## Other",
            "- `ballet_chat/`: `run.py` and",
            "  `client.py`; see `docs/`",
        ]
    )
    named = {(n.token, n.bases) for n in named_paths(text)}
    assert ("turn/", ("service/core/",)) in named
    assert ("loop.py", ("service/core/turn/", "service/core/")) in named
    assert ("server/root.py", ("service/", "")) in named
    assert ("client.py", ("ballet_chat/", "")) in named
    assert ("docs/", ("ballet_chat/", "")) in named
