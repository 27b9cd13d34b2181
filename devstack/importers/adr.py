"""Import a folder of ADR markdown files as knowledge entries of kind decision (README.md).

Files named ``NNNN-title.md`` in Nygard format: ``# N. Title``, ``Date: YYYY-MM-DD``, a
``## Status`` section, then context, decision and consequences. The mapping
(docs/decisions/0105-devstack-adr-and-skill-import.md):

- entry id ``adr-NNNN``; title without the leading ``N.``; the body is the file after its
  title line; the date becomes the creation time.
- status: the first word of the status section without its emoji, lower-cased
  (``✅ Accepted`` -> ``accepted``; ``⌛️ Superseded [0019](0019-....md)`` -> ``superseded``).
- supersession: ADR numbers named in the status section (as links to ``NNNN-*.md``, ``[NNNN]`` or
  ``ADR NNNN``). A "Superseded" status means this entry is superseded by
  them; a "Supersedes" one means it supersedes them.

Entries are upserted by source (``adr:<org>:NNNN``): re-importing an unchanged file does
nothing, a changed file adds a version.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from devstack.importers.errors import ImportFileError, read_text, unreadable
from devstack.store import Store
from devstack.store import knowledge as knowledge_store

RECORDED_BY = "import:adr"
#: This import's name in errors (the ``--knowledge`` folder).
IMPORTER = "knowledge"
_FILE = re.compile(r"^(\d{4})-.+\.md$")
_TITLE = re.compile(r"^#\s+(?:\d+\.\s*)?(.+?)\s*$", re.MULTILINE)
_DATE = re.compile(r"^Date:\s*(\d{4}-\d{2}-\d{2})\s*$", re.MULTILINE | re.IGNORECASE)
_STATUS = re.compile(r"^##\s+Status\s*$(.*?)(?=^##\s|\Z)", re.MULTILINE | re.DOTALL | re.IGNORECASE)
_LINKED = re.compile(r"\]\((?:\./)?(\d{4})-[^)]*\.md\)")
# A bare reference: "ADR 0019", "ADR-0019" or "[0019]" (not any four digits: years).
_NUMBER = re.compile(r"(?:\badr[\s-]?|\[)(\d{4})\b", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Adr:
    """One parsed ADR file."""

    number: str
    title: str
    body: str
    status: str
    date: float | None
    superseded_by: tuple[str, ...]
    supersedes: tuple[str, ...]

    @property
    def entry_id(self) -> str:
        """The knowledge entry id, ``adr-NNNN``."""
        return f"adr-{self.number}"


def parse_adr(path: Path) -> Adr:
    """Parse one ADR file.

    Raises ``ImportFileError`` when its name has no ``NNNN-`` prefix, it cannot be read,
    is not UTF-8, or its ``Date:`` line is not a date (naming the line).
    """
    match = _FILE.match(path.name)
    if match is None:
        raise ImportFileError(IMPORTER, path, "not an ADR file (NNNN-title.md)")
    number = match.group(1)
    text = read_text(IMPORTER, path)
    title_match = _TITLE.search(text)
    title = title_match.group(1) if title_match else path.stem
    body = text[title_match.end() :].strip() if title_match else text.strip()
    date_match = _DATE.search(text)
    date = None
    if date_match:
        try:
            when = datetime.strptime(date_match.group(1), "%Y-%m-%d")
        except ValueError:
            line = text.count("\n", 0, date_match.start()) + 1
            problem = f"Date {date_match.group(1)} is not a calendar date"
            raise ImportFileError(IMPORTER, path, problem, line) from None
        date = when.replace(tzinfo=UTC).timestamp()
    section = _STATUS.search(text)
    status_text = section.group(1).strip() if section else ""
    first_line = status_text.splitlines()[0] if status_text else ""
    word = _WORD.search(first_line)
    status = word.group(0).lower() if word else ""
    named = list(dict.fromkeys(_LINKED.findall(status_text) + _NUMBER.findall(status_text)))
    named = [other for other in named if other != number]
    superseded_by: tuple[str, ...] = ()
    supersedes: tuple[str, ...] = ()
    lowered = status_text.lower()
    if "superseded" in lowered:
        superseded_by = tuple(named)
    elif "supersedes" in lowered:
        supersedes = tuple(named)
    return Adr(number, title, body, status, date, superseded_by, supersedes)


def read_adrs(folder: Path) -> list[Adr]:
    """Parse every ``NNNN-*.md`` of ``folder``, in file name order. Raises
    ``ImportFileError`` when ``folder`` cannot be listed or a file cannot be parsed."""
    try:
        paths = sorted(folder.iterdir())
    except OSError as error:
        raise unreadable(IMPORTER, folder, error) from None
    return [parse_adr(path) for path in paths if _FILE.match(path.name)]


@dataclass(frozen=True)
class AdrReport:
    """What an import did: entries created, updated and unchanged; supersession links."""

    created: int
    updated: int
    unchanged: int
    supersessions: int


async def import_adrs(store: Store, folder: Path, *, org_id: str = "acme") -> AdrReport:
    """Import every ``NNNN-*.md`` of ``folder`` into ``org_id``'s knowledge, in one
    transaction. Other files (the index README) are ignored."""
    adrs = await asyncio.to_thread(read_adrs, folder)
    counts = {"created": 0, "updated": 0, "unchanged": 0, "links": 0}

    async def unit(session: AsyncSession) -> None:
        for adr in adrs:
            counts[await _put(session, adr, org_id)] += 1
        known = {adr.number for adr in adrs}
        newer_of: dict[str, list[str]] = {adr.number: list(adr.supersedes) for adr in adrs}
        for adr in adrs:
            for newer in adr.superseded_by:
                if newer in known and adr.number not in newer_of[newer]:
                    newer_of[newer].append(adr.number)
        for number, older in newer_of.items():
            older = [other for other in older if other in known]
            counts["links"] += len(older)
            await knowledge_store.set_supersedes(
                session, f"adr-{number}", [f"adr-{other}" for other in older]
            )

    await store.run_write(unit)
    return AdrReport(counts["created"], counts["updated"], counts["unchanged"], counts["links"])


async def _put(session: AsyncSession, adr: Adr, org_id: str) -> str:
    source_id = f"adr:{org_id}:{adr.number}"
    found = await knowledge_store.entry_id_for_source(session, source_id)
    if found is None:
        await knowledge_store.create_entry(
            session,
            org_id=org_id,
            kind="decision",
            title=adr.title,
            body=adr.body,
            status=adr.status,
            project_ids=[],
            item_ids=[],
            author_id="",
            recorded_by=RECORDED_BY,
            entry_id=adr.entry_id if org_id == "acme" else f"{org_id}-{adr.entry_id}",
            source_id=source_id,
            create_time=adr.date,
        )
        return "created"
    entry_id, version = found
    current = await knowledge_store.get_entry(session, org_id=org_id, entry_id=entry_id)
    if (current.title, current.body, current.status) == (adr.title, adr.body, adr.status):
        return "unchanged"
    await knowledge_store.update_entry(
        session,
        org_id=org_id,
        entry_id=entry_id,
        expected_version=version,
        recorded_by=RECORDED_BY,
        title=adr.title,
        body=adr.body,
        status=adr.status,
    )
    return "updated"
