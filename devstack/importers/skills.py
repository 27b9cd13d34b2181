"""Import a folder of skills (``<name>/SKILL.md`` with YAML front matter) (SPEC section 9).

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

from devstack.store import Store
from devstack.store.skills import put_skill_version

SKILL_FILE = "SKILL.md"


@dataclass(frozen=True)
class SkillFile:
    """A parsed SKILL.md: front matter name and description, and the whole text."""

    name: str
    description: str
    content: str


def parse_skill(path: Path) -> SkillFile:
    """Parse a SKILL.md; the folder name stands in for a missing ``name``.

    Raises ``ValueError`` when the file has no front matter or its YAML is not a mapping.
    """
    content = path.read_text(encoding="utf-8")
    lines = content.splitlines()
    if not lines or lines[0].strip() != "---":
        raise ValueError(f"{path}: no YAML front matter")
    try:
        end = next(index for index, line in enumerate(lines[1:], 1) if line.strip() == "---")
    except StopIteration:
        raise ValueError(f"{path}: the front matter is not closed with ---") from None
    front = yaml.safe_load("\n".join(lines[1:end])) or {}
    if not isinstance(front, dict):
        raise ValueError(f"{path}: the front matter is not a mapping")
    name = str(front.get("name") or path.parent.name).strip()
    description = " ".join(str(front.get("description") or "").split())
    return SkillFile(name=name, description=description, content=content)


def read_skills(folder: Path) -> list[SkillFile]:
    """Parse every ``<name>/SKILL.md`` under ``folder``, in folder name order."""
    return [
        parse_skill(child / SKILL_FILE)
        for child in sorted(folder.iterdir())
        if (child / SKILL_FILE).is_file()
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
