"""Hybrid search: keyword ranking fused with character-trigram similarity of titles.

docs/decisions/0103-devstack-hybrid-search.md explains the choice. In short:

- Keyword ranking: SQLite FTS5 ``bm25`` (title weighted 4:1 over body) or PostgreSQL
  ``ts_rank`` over a weighted ``tsvector``; the query's words are OR-ed, so a document
  that matches more of them ranks higher instead of a single missing word hiding it.
  Both stem English words ("blocking" finds "blocked").
- Trigram similarity: the share of the query's character trigrams (pg_trgm-style padding)
  found in a title, so typos ("daemn") and word fragments still find the item, which a
  stemmed keyword index cannot.
- Reciprocal rank fusion (``1 / (60 + rank)`` summed over the lists): it needs only ranks,
  so bm25 (unbounded) and a 0..1 similarity need no calibration against each other.

Everything here is engine-neutral except ``keyword_ranking``.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from functools import lru_cache
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.store.db import upsert
from devstack.store.schema import search_docs

K = TypeVar("K", bound=Hashable)

#: The constant of reciprocal rank fusion (Cormack et al. 2009 found 60 robust).
RRF_K = 60
#: The share of a query's trigrams a title must contain to enter the trigram list.
TRIGRAM_THRESHOLD = 0.5
#: How many candidates each signal contributes before fusion.
CANDIDATES = 200
SNIPPET_CHARS = 160

_WORD = re.compile(r"\w+", re.UNICODE)


def query_words(text: str) -> list[str]:
    """The distinct lower-case words of a query, in order (at most 32)."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(text.lower()):
        seen.setdefault(word, None)
    return list(seen)[:32]


@lru_cache(maxsize=65536)
def trigrams(text: str) -> frozenset[str]:
    """The character trigrams of ``text``'s words, each padded as pg_trgm does (``"  w "``)."""
    grams: set[str] = set()
    for word in _WORD.findall(text.lower()):
        padded = f"  {word} "
        grams.update(padded[i : i + 3] for i in range(len(padded) - 2))
    return frozenset(grams)


def trigram_ranking(query: str, candidates: Iterable[tuple[K, str]]) -> list[K]:
    """Keys of ``candidates`` (key, text) whose text holds enough of the query's trigrams.

    Ordered by that share (containment), then by Jaccard similarity so a short, close
    title beats a long one that merely contains the words; at most ``CANDIDATES``.
    """
    wanted = trigrams(query)
    if not wanted:
        return []
    scored: list[tuple[float, float, int, K]] = []
    for index, (key, text) in enumerate(candidates):
        grams = trigrams(text)
        common = len(wanted & grams)
        containment = common / len(wanted)
        if containment >= TRIGRAM_THRESHOLD:
            jaccard = common / len(wanted | grams)
            scored.append((-containment, -jaccard, index, key))
    scored.sort(key=lambda entry: entry[:3])
    return [key for *_rest, key in scored[:CANDIDATES]]


def fuse(rankings: Sequence[Sequence[K]]) -> list[tuple[K, float]]:
    """Reciprocal rank fusion of best-first rankings: (key, score), best first.

    Ties keep the order of first appearance (earlier lists first), so results are stable.
    """
    scores: dict[K, float] = {}
    for ranking in rankings:
        for rank, key in enumerate(ranking, start=1):
            scores[key] = scores.get(key, 0.0) + 1.0 / (RRF_K + rank)
    order = {key: index for index, key in enumerate(scores)}
    return sorted(scores.items(), key=lambda pair: (-pair[1], order[pair[0]]))


def snippet(text: str, words: Sequence[str], width: int = SNIPPET_CHARS) -> str:
    """About ``width`` characters of ``text`` where most distinct query words appear
    (the earliest such window on a tie; the start of ``text`` when none appears)."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    lower = flat.lower()
    wanted = [word for word in words if len(word) > 1]
    positions = sorted(
        match.start() for word in wanted for match in re.finditer(re.escape(word), lower)
    )
    best, start = 0, 0
    for position in positions[:200]:
        begin = max(0, position - width // 4)
        window = lower[begin : begin + width]
        count = sum(1 for word in wanted if word in window)
        if count > best:
            best, start = count, begin
    end = min(len(flat), start + width)
    start = max(0, end - width)
    return ("…" if start else "") + flat[start:end] + ("…" if end < len(flat) else "")


async def keyword_ranking(
    session: AsyncSession,
    dialect: str,
    words: Sequence[str],
    *,
    org_id: str,
    scopes: Sequence[tuple[str, Sequence[str]]],
    limit: int = CANDIDATES,
) -> list[tuple[str, str]]:
    """``(doc_type, ref_id)`` of the documents matching any of ``words``, best first.

    ``scopes`` lists ``(doc_type, project_ids)`` pairs to search within ``org_id``; an
    empty ``project_ids`` means any project. Uses FTS5 ``bm25`` on SQLite and ``ts_rank``
    on PostgreSQL.
    """
    if not words or not scopes:
        return []
    params: dict[str, object] = {"org": org_id, "limit": limit}
    clauses = []
    for index, (doc_type, project_ids) in enumerate(scopes):
        params[f"type{index}"] = doc_type
        clause = f"d.doc_type = :type{index}"
        if project_ids:
            names = []
            for position, project_id in enumerate(project_ids):
                params[f"p{index}_{position}"] = project_id
                names.append(f":p{index}_{position}")
            clause += f" AND d.project_id IN ({', '.join(names)})"
        clauses.append(f"({clause})")
    scope = " OR ".join(clauses)
    if dialect == "sqlite":
        # Each word quoted, so FTS5 query syntax in user text is never interpreted.
        params["match"] = " OR ".join('"' + word.replace('"', '""') + '"' for word in words)
        statement = sa.text(
            "SELECT d.doc_type, d.ref_id FROM ds_search_fts "
            "JOIN ds_search_docs d ON d.doc_id = ds_search_fts.rowid "
            f"WHERE ds_search_fts MATCH :match AND d.org_id = :org AND ({scope}) "
            "ORDER BY bm25(ds_search_fts, 4.0, 1.0), d.doc_id LIMIT :limit"
        )
    else:
        terms = []
        for position, word in enumerate(words):
            params[f"w{position}"] = word
            terms.append(f"plainto_tsquery('english', :w{position})")
        statement = sa.text(
            "SELECT d.doc_type, d.ref_id FROM ds_search_docs d, "
            f"(SELECT {' || '.join(terms)} AS q) AS query "
            f"WHERE d.tsv @@ query.q AND d.org_id = :org AND ({scope}) "
            "ORDER BY ts_rank(d.tsv, query.q) DESC, d.doc_id LIMIT :limit"
        )
    rows = (await session.execute(statement, params)).all()
    return [(str(row[0]), str(row[1])) for row in rows]


async def put_documents(session: AsyncSession, rows: Sequence[dict[str, str]]) -> None:
    """Insert or update search documents, keyed by ``(doc_type, ref_id)``.

    Each row has ``doc_type``, ``ref_id``,
    ``org_id``, ``project_id``, ``title`` and ``body``. On SQLite the FTS5 index follows by
    trigger; on PostgreSQL the ``tsvector`` column is generated.
    """
    if not rows:
        return
    insert = upsert(session, search_docs)
    statement = insert.on_conflict_do_update(
        index_elements=["doc_type", "ref_id"],
        set_={name: insert.excluded[name] for name in ("org_id", "project_id", "title", "body")},
    )
    await session.execute(statement, list(rows))
