"""Skills: organization and project skills, their versions, and per-project pins.

A project's effective skills are its own skills plus the organization's, where a project
skill hides an organization skill of the same name (skills.proto ``SKILL_SCOPE_PROJECT``).
The version a project resolves is its pin, else the latest version by number
(docs/spec/turn-loop.md, "in the version the project resolves (pins apply)").
"""

from __future__ import annotations

import hashlib
import re
import time

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.errors import InvalidArgument, NotFound
from devstack.store.records import SkillView
from devstack.store.schema import skill_pins, skill_versions, skills
from devstack.store.search import put_documents

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
FIRST_VERSION = "1.0.0"


def parse_version(version: str) -> tuple[int, int, int]:
    """``"1.2.3"`` -> ``(1, 2, 3)``; ``InvalidArgument`` (INVALID_VERSION) otherwise."""
    match = _VERSION.match(version)
    if match is None:
        raise InvalidArgument("INVALID_VERSION", f"not a MAJOR.MINOR.PATCH version: {version!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def next_minor(version: str) -> str:
    """The version after ``version`` for changed content: ``1.0.0`` -> ``1.1.0``."""
    major, minor, _patch = parse_version(version)
    return f"{major}.{minor + 1}.0"


async def put_skill_version(
    session: AsyncSession,
    *,
    org_id: str,
    project_id: str,
    name: str,
    description: str,
    content: str,
    version: str | None = None,
) -> tuple[str, bool]:
    """Add a version of a skill unless its latest version has the same content.

    ``project_id`` is empty for an organization skill. ``version`` defaults to
    ``1.0.0`` for a new skill and to the next minor version after the latest otherwise.
    Returns the version that now holds ``content`` and whether it was added. An explicit
    ``version`` that exists with other content raises ``InvalidArgument``.
    """
    skill_id = await session.scalar(
        sa.select(skills.c.skill_id).where(
            skills.c.org_id == org_id, skills.c.project_id == project_id, skills.c.name == name
        )
    )
    if skill_id is None:
        skill_id = await session.scalar(
            sa.insert(skills)
            .values(org_id=org_id, project_id=project_id, name=name)
            .returning(skills.c.skill_id)
        )
    digest = hashlib.sha256(content.encode()).hexdigest()
    rows = (
        await session.execute(
            sa.select(skill_versions.c.version, skill_versions.c.content_sha256)
            .where(skill_versions.c.skill_id == skill_id)
            .order_by(
                skill_versions.c.major.desc(),
                skill_versions.c.minor.desc(),
                skill_versions.c.patch.desc(),
            )
        )
    ).all()
    existing = {str(row.version): str(row.content_sha256) for row in rows}
    if version is not None and version in existing:
        if existing[version] != digest:
            raise InvalidArgument(
                "VERSION_EXISTS", f"skill {name!r} already has a different {version}"
            )
        return version, False
    if version is None and rows:
        if rows[0].content_sha256 == digest:
            return str(rows[0].version), False
        version = next_minor(str(rows[0].version))
    version = version or FIRST_VERSION
    major, minor, patch = parse_version(version)
    await session.execute(
        sa.insert(skill_versions).values(
            skill_id=skill_id,
            version=version,
            major=major,
            minor=minor,
            patch=patch,
            description=description,
            content=content,
            content_sha256=digest,
            create_time=time.time(),
        )
    )
    await put_documents(
        session,
        [
            {
                "doc_type": "skill",
                "ref_id": f"{skill_id}@{version}",
                "org_id": org_id,
                "project_id": project_id,
                "title": f"{name} {description}",
                "body": content,
            }
        ],
    )
    return version, True


async def pin(
    session: AsyncSession, *, org_id: str, project_id: str, name: str, version: str
) -> None:
    """Pin the project's effective skill ``name`` to ``version`` (which must exist)."""
    view = await read_skill(session, org_id=org_id, project_id=project_id, name=name)
    found = await session.scalar(
        sa.select(skill_versions.c.version).where(
            skill_versions.c.skill_id == view.skill_id, skill_versions.c.version == version
        )
    )
    if found is None:
        raise NotFound("SKILL_VERSION_NOT_FOUND", f"skill {name!r} has no version {version}")
    await session.execute(
        sa.delete(skill_pins).where(
            skill_pins.c.project_id == project_id, skill_pins.c.skill_id == view.skill_id
        )
    )
    await session.execute(
        sa.insert(skill_pins).values(project_id=project_id, skill_id=view.skill_id, version=version)
    )


async def effective_skills(
    session: AsyncSession, *, org_id: str, project_id: str, with_content: bool = False
) -> list[SkillView]:
    """The project's effective skills, by name, each in the version the project resolves."""
    skill_rows = (
        await session.execute(
            sa.select(skills.c.skill_id, skills.c.project_id, skills.c.name).where(
                skills.c.org_id == org_id, skills.c.project_id.in_(["", project_id])
            )
        )
    ).all()
    chosen: dict[str, tuple[int, str]] = {}
    for skill_id, owner, name in skill_rows:
        # A project skill hides the organization skill of the same name.
        if name not in chosen or owner:
            chosen[name] = (int(skill_id), "project" if owner else "organization")
    if not chosen:
        return []
    ids = [skill_id for skill_id, _scope in chosen.values()]
    columns = [
        skill_versions.c.skill_id,
        skill_versions.c.version,
        skill_versions.c.description,
        skill_versions.c.major,
        skill_versions.c.minor,
        skill_versions.c.patch,
    ]
    if with_content:
        columns.append(skill_versions.c.content)
    version_rows = (
        (await session.execute(sa.select(*columns).where(skill_versions.c.skill_id.in_(ids))))
        .mappings()
        .all()
    )
    pins = {
        int(skill_id): str(version)
        for skill_id, version in (
            await session.execute(
                sa.select(skill_pins.c.skill_id, skill_pins.c.version).where(
                    skill_pins.c.project_id == project_id, skill_pins.c.skill_id.in_(ids)
                )
            )
        ).all()
    }
    by_skill: dict[int, dict[str, sa.RowMapping]] = {}
    latest: dict[int, tuple[tuple[int, int, int], str]] = {}
    for row in version_rows:
        skill_id = int(row["skill_id"])
        by_skill.setdefault(skill_id, {})[row["version"]] = row
        number = (row["major"], row["minor"], row["patch"])
        if skill_id not in latest or number > latest[skill_id][0]:
            latest[skill_id] = (number, row["version"])
    views: list[SkillView] = []
    for name in sorted(chosen):
        skill_id, scope = chosen[name]
        if skill_id not in latest:
            continue
        latest_version = latest[skill_id][1]
        pinned = pins.get(skill_id)
        version = pinned if pinned in by_skill[skill_id] else latest_version
        row = by_skill[skill_id][version]
        views.append(
            SkillView(
                name=name,
                description=row["description"],
                scope=scope,
                version=version,
                pinned=version == pinned,
                latest_version=latest_version,
                skill_id=skill_id,
                content=row["content"] if with_content else "",
            )
        )
    return views


async def read_skill(
    session: AsyncSession, *, org_id: str, project_id: str, name: str
) -> SkillView:
    """The effective skill ``name`` with its resolved version's SKILL.md as ``content``.

    Raises ``NotFound`` (SKILL_NOT_FOUND) when the project has no such skill.
    """
    for view in await effective_skills(
        session, org_id=org_id, project_id=project_id, with_content=True
    ):
        if view.name == name:
            return view
    raise NotFound(
        "SKILL_NOT_FOUND",
        f"skill {name!r} not found in project {project_id!r}",
        {"skill": name, "project_id": project_id},
    )
