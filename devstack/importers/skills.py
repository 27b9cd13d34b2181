"""Import a folder of skills (``<name>/SKILL.md`` with YAML front matter) (README.md).

Each ``SKILL.md`` starts with ``---``, YAML with at least ``name`` and ``description``,
``---``, then markdown. Skills are imported as organization skills; the first import
creates version ``1.0.0`` and a re-import with changed content adds the next minor
version (``1.1.0``), an unchanged one adds nothing (docs/decisions/0105). The stored
content is the whole file, front matter included (``ReadSkillResponse.content``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import yaml
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.importers.errors import ImportFileError, read_text, unreadable
from devstack.store import Store
from devstack.store.skills import put_skill_version

SKILL_FILE = "SKILL.md"
#: This import's name in errors (the ``--skills`` folder).
IMPORTER = "skills"


@dataclass(frozen=True)
class SkillFile:
    """A parsed SKILL.md: front matter name and description, and the whole text."""

    name: str
    description: str
    content: str


def parse_skill(path: Path) -> SkillFile:
    """Parse a SKILL.md; the folder name stands in for a missing ``name``.

    Raises ``ImportFileError`` naming the file (and the line, where there is one) when it
    cannot be read, is not UTF-8, has no front matter, or its YAML does not parse or is
    not a mapping.
    """
    content = read_text(IMPORTER, path)
    lines = content.splitlines()
    if not lines or lines[0].strip() != "---":
        raise ImportFileError(IMPORTER, path, "no YAML front matter (a first line ---)", 1)
    try:
        end = next(index for index, line in enumerate(lines[1:], 1) if line.strip() == "---")
    except StopIteration:
        raise ImportFileError(
            IMPORTER, path, "the front matter is not closed with ---", 1
        ) from None
    try:
        front = yaml.safe_load("\n".join(lines[1:end])) or {}
    except yaml.YAMLError as error:
        raise _yaml_error(path, error) from None
    if not isinstance(front, dict):
        raise ImportFileError(IMPORTER, path, "the front matter is not a mapping", 2)
    name = str(front.get("name") or path.parent.name).strip()
    description = " ".join(str(front.get("description") or "").split())
    return SkillFile(name=name, description=description, content=content)


def _yaml_error(path: Path, error: yaml.YAMLError) -> ImportFileError:
    """One line for a YAML error in the front matter, which starts on the file's line 2."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    text = " ".join(f"the front matter is not valid YAML ({problem})".split())
    return ImportFileError(IMPORTER, path, text, mark.line + 2 if mark is not None else None)


def read_skills(folder: Path) -> list[SkillFile]:
    """Parse every ``<name>/SKILL.md`` under ``folder``, in folder name order. Raises
    ``ImportFileError`` when ``folder`` cannot be listed or a file cannot be parsed."""
    try:
        children = sorted(folder.iterdir())
    except OSError as error:
        raise unreadable(IMPORTER, folder, error) from None
    return [
        parse_skill(child / SKILL_FILE) for child in children if (child / SKILL_FILE).is_file()
    ]


@dataclass(frozen=True)
class SkillsReport:
    """What an import did: the version each skill now has, and which were added."""

    versions: dict[str, str]
    added: tuple[str, ...]


async def import_skills(
    store: Store, folder: Path, *, org_id: str = "acme", project_id: str = ""
) -> SkillsReport:
    """Import every ``<name>/SKILL.md`` under ``folder`` (organization skills unless
    ``project_id`` is given), in one transaction."""
    files = await asyncio.to_thread(read_skills, folder)
    versions: dict[str, str] = {}
    added: list[str] = []

    async def unit(session: AsyncSession) -> None:
        versions.clear()
        added.clear()
        for skill in files:
            version, new = await put_skill_version(
                session,
                org_id=org_id,
                project_id=project_id,
                name=skill.name,
                description=skill.description,
                content=skill.content,
            )
            versions[skill.name] = version
            if new:
                added.append(f"{skill.name}@{version}")

    await store.run_write(unit)
    return SkillsReport(versions=dict(versions), added=tuple(added))
