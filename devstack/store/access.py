"""Organizations, users, project roles and the permissions they grant.

The model (docs/decisions/0101-devstack-permission-model.md):

- A human's permissions in a project are those of their role there (``ROLE_PERMISSIONS``).
  A project is visible only to humans with a role on it and only within the token's
  organization; anyone else gets ``NOT_FOUND`` for it, so its existence does not leak
  (docs/spec/authority.md). A visible project with a missing permission gives ``PERMISSION_DENIED``.
- Knowledge is organization-wide (docs/spec/turn-loop.md, "the organization's knowledge base"): a
  human's knowledge permissions in an organization are the union of their roles'
  permissions over the organization's projects.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.auth import ROLE_PERMISSIONS, ROLE_SUMMARIES
from devstack.errors import NotFound, PermissionDenied
from devstack.store.records import Access, ProjectRecord
from devstack.store.schema import organizations, project_roles, projects, users

#: The organizations of the dev stack: id -> name.
ORGANIZATIONS = {"acme": "Acme Corp", "globex": "Globex"}
#: The dev users: id -> (organization, display name). README.md names alice and bob.
USERS = {
    "alice": ("acme", "Alice"),
    "bob": ("acme", "Bob"),
    # In another organization, with no role in acme: for isolation tests.
    "carol": ("globex", "Carol"),
    # Test users: a role that grants nothing, and one that grants only skill.read.
    "dave": ("acme", "Dave"),
    "erin": ("acme", "Erin"),
}
#: The role each user gets on every project of their organization.
DEFAULT_ROLES = {
    "alice": "maintainer",
    "bob": "viewer",
    "carol": "maintainer",
    "dave": "guest",
    "erin": "skill-reader",
}


def describe_users(projects: dict[str, str] | None = None) -> list[str]:
    """The dev users as ``dev``'s banner lists them, one line per organization, from
    ``USERS`` and ``DEFAULT_ROLES`` (the table the devstack seeds and records for the
    chat's and token's check, ``ballet_common.devusers``): "organization acme: alice (all
    five permissions), bob (read permissions only), ...". ``projects`` names an
    organization's project where the banner does not otherwise ("organization globex,
    project globex-ops: carol ..."), so its users know what to chat about."""
    by_org: dict[str, list[str]] = {}
    for user, (org, _) in USERS.items():
        by_org.setdefault(org, []).append(f"{user} ({ROLE_SUMMARIES[DEFAULT_ROLES[user]]})")
    named = projects or {}
    return [
        f"organization {org}{f', project {named[org]}' if org in named else ''}: {', '.join(names)}"
        for org, names in by_org.items()
    ]


async def seed_identities(session: AsyncSession) -> None:
    """Create the organizations and users if missing (they never change)."""
    existing_orgs = set((await session.scalars(sa.select(organizations.c.org_id))).all())
    for org_id, name in ORGANIZATIONS.items():
        if org_id not in existing_orgs:
            await session.execute(sa.insert(organizations).values(org_id=org_id, name=name))
    existing_users = set((await session.scalars(sa.select(users.c.user_id))).all())
    for user_id, (org_id, name) in USERS.items():
        if user_id not in existing_users:
            await session.execute(
                sa.insert(users).values(user_id=user_id, org_id=org_id, name=name)
            )


async def put_project(
    session: AsyncSession,
    *,
    project_id: str,
    org_id: str,
    name: str,
    description: str,
    settings: dict[str, str],
) -> None:
    """Create or replace a project, and give its organization's users their default roles."""
    row = {
        "org_id": org_id,
        "name": name,
        "description": description,
        "settings": settings,
    }
    found = await session.scalar(
        sa.select(projects.c.project_id).where(projects.c.project_id == project_id)
    )
    if found is None:
        await session.execute(sa.insert(projects).values(project_id=project_id, **row))
    else:
        await session.execute(
            sa.update(projects).where(projects.c.project_id == project_id).values(**row)
        )
    roles = set(
        (
            await session.scalars(
                sa.select(project_roles.c.user_id).where(project_roles.c.project_id == project_id)
            )
        ).all()
    )
    for user_id, (user_org, _name) in USERS.items():
        if user_org == org_id and user_id not in roles:
            await session.execute(
                sa.insert(project_roles).values(
                    project_id=project_id, user_id=user_id, role=DEFAULT_ROLES[user_id]
                )
            )


async def set_role(session: AsyncSession, *, user: str, project_id: str, role: str | None) -> None:
    """Give ``user`` the ``role`` on ``project_id``, replacing any role they had, or take
    it away (None). Raises ``ValueError`` for an unknown role, user or project."""
    if role is not None and role not in ROLE_PERMISSIONS:
        raise ValueError(f"unknown role {role!r}")
    if user not in USERS:
        raise ValueError(f"unknown user {user!r}")
    found = await session.scalar(
        sa.select(projects.c.project_id).where(projects.c.project_id == project_id)
    )
    if found is None:
        raise ValueError(f"unknown project {project_id!r}")
    await session.execute(
        sa.delete(project_roles).where(
            project_roles.c.project_id == project_id, project_roles.c.user_id == user
        )
    )
    if role is not None:
        await session.execute(
            sa.insert(project_roles).values(project_id=project_id, user_id=user, role=role)
        )


async def project_access(
    session: AsyncSession, *, human: str, organization_id: str, project_id: str
) -> Access:
    """The project and the human's permissions on it.

    Raises ``NotFound`` (PROJECT_NOT_FOUND) when the project does not exist, belongs to
    another organization than the token's, or the human has no role on it: the three are
    indistinguishable to the caller.
    """
    query = (
        sa.select(projects, organizations.c.name.label("org_name"), project_roles.c.role)
        .join(organizations, organizations.c.org_id == projects.c.org_id)
        .join(
            project_roles,
            sa.and_(
                project_roles.c.project_id == projects.c.project_id,
                project_roles.c.user_id == human,
            ),
        )
        .where(projects.c.project_id == project_id, projects.c.org_id == organization_id)
    )
    row = (await session.execute(query)).mappings().first()
    if row is None:
        raise NotFound(
            "PROJECT_NOT_FOUND", f"project {project_id!r} not found", {"project_id": project_id}
        )
    project = ProjectRecord(
        project_id=row["project_id"],
        name=row["name"],
        description=row["description"],
        organization_id=row["org_id"],
        organization_name=row["org_name"],
        settings={str(k): str(v) for k, v in (row["settings"] or {}).items()},
    )
    return Access(project=project, permissions=ROLE_PERMISSIONS.get(row["role"], frozenset()))


async def organization_permissions(
    session: AsyncSession, *, human: str, organization_id: str
) -> frozenset[str]:
    """The union of the human's role permissions over the organization's projects."""
    query = (
        sa.select(project_roles.c.role)
        .join(projects, projects.c.project_id == project_roles.c.project_id)
        .where(project_roles.c.user_id == human, projects.c.org_id == organization_id)
        .distinct()
    )
    granted: set[str] = set()
    for role in (await session.scalars(query)).all():
        granted |= ROLE_PERMISSIONS.get(role, frozenset())
    return frozenset(granted)


def require(permissions: frozenset[str], permission: str, *, where: str) -> None:
    """Raise ``PermissionDenied`` (PERMISSION_DENIED) unless ``permission`` is granted.

    ``where`` names the project or organization for the message and ErrorInfo metadata.
    """
    if permission not in permissions:
        raise PermissionDenied(
            "PERMISSION_DENIED",
            f"{permission} is required in {where}",
            {"permission": permission, "scope": where},
        )
