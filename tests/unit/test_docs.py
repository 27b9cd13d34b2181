"""The documentation explains the repository from inside it.

- Every decision record in ``docs/decisions/`` is listed in its index
  (``docs/decisions/README.md``), and the index lists no record that does not exist.
- Every relative link in ``README.md`` and ``docs/`` resolves to a file or folder of the
  repository.
- No file of the repository cites a document that is not in it (the design documents the
  planner was first built from, a tracker's issue numbers): it cites a file a reader can
  open (``docs/spec/<file>.md``, a decision record) or states the rule itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DECISIONS = DOCS / "decisions"
INDEX = DECISIONS / "README.md"

#: A record's file name: four digits, a dash, a slug.
RECORD = re.compile(r"^\d{4}-[a-z0-9-]+\.md$")
#: Markdown links and images: ``[text](target)``; the target up to a space or ``)``.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: Code (fenced blocks and inline spans): what looks like a link there is an example.
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)

#: Citations of documents outside the repository, in the forms they took: a section of
#: the design specification, the design page it came from, the numbered rules of a
#: style guide, and a tracker's issues and their acceptance lists.
CITATIONS = re.compile(
    "|".join(
        (
            r"\bSPEC\b",
            r"\bspec(?:\.md)? ?(?:section|§)",
            r"\bsection [0-9]+ of\b",
            r"\bseed(?:'s\b|:? (?:Authority|Instructions|Planner|Tools|Limits|Context)\b)",
            r"\b(?-i:seed)\)",
            r"\bseed: [\"(\[]",
            r"\bseed `",
            r"\bthe seed\b",
            r"\bSTYLE\b",
            r"\bstyle rule [0-9]",
            r"\bissues? #?[0-9]+",
            r"\bDone[- ]when\b",
            r"\bissue's\b",
            r"\bissue-sized\b",
            r"\bshared/(?:seed|design)/",
        )
    ),
    re.IGNORECASE,
)
#: Case matters for these two: ``spec`` and ``style`` are ordinary words in lower case.
CASE_SENSITIVE = ("SPEC", "STYLE")

#: Folders that are not the repository's own text: generated code, vendored protos,
#: environments and build output.
SKIPPED_DIRS = {
    ".git",
    ".venv",
    "generated",
    "third_party",
    "build",
    "dist",
    "node_modules",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".ballet-dev",
}
TEXT_SUFFIXES = {
    ".py", ".md", ".toml", ".yaml", ".yml", ".json", ".proto", ".sh", ".txt", ".cfg",
    ".ini", ".sql", ".mako", "",
}  # fmt: skip


def _records() -> set[str]:
    return {path.name for path in DECISIONS.iterdir() if RECORD.match(path.name)}


def _links(page: Path) -> list[str]:
    return LINK.findall(CODE.sub("", page.read_text(encoding="utf-8")))


def _indexed() -> set[str]:
    targets = {Path(target.split("#", 1)[0]).name for target in _links(INDEX)}
    return {name for name in targets if RECORD.match(name)}


def test_every_decision_record_is_in_the_index() -> None:
    missing = sorted(_records() - _indexed())
    assert not missing, f"docs/decisions/README.md does not list {missing}"


def test_the_index_lists_only_records_that_exist() -> None:
    unknown = sorted(_indexed() - _records())
    assert not unknown, f"docs/decisions/README.md lists records that do not exist: {unknown}"


def _markdown_files() -> Iterator[Path]:
    yield ROOT / "README.md"
    yield from sorted(DOCS.rglob("*.md"))


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for page in _markdown_files():
        for target in _links(page):
            if not _is_relative(target):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if path.exists():
                continue
            broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_link_pattern_reads_the_forms_the_docs_use() -> None:
    text = '[a](b.md) ![c](d/e.png) [f](g.md#h) [i](https://x.y/z) [j](k.md "title")'
    assert LINK.findall(CODE.sub("", text + " `[l](m.md)`\n```\n[n](o.md)\n```")) == [
        "b.md",
        "d/e.png",
        "g.md#h",
        "https://x.y/z",
        "k.md",
    ]
    assert [t for t in LINK.findall(text) if _is_relative(t)] == [
        "b.md",
        "d/e.png",
        "g.md#h",
        "k.md",
    ]


def _repository_text() -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in parts):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES and path != Path(__file__):
            yield path


def _citations(text: str) -> list[str]:
    found = []
    for match in CITATIONS.finditer(text):
        word = match.group(0)
        if word.upper() in CASE_SENSITIVE and word not in CASE_SENSITIVE:
            continue
        found.append(word)
    return found


def test_no_file_cites_a_document_outside_the_repository() -> None:
    cited = []
    for path in _repository_text():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if found := _citations(line):
                cited.append(f"{path.relative_to(ROOT)}:{number}: {', '.join(found)}")
    assert not cited, (
        "cite a file of the repository (docs/spec/, a decision record) or state the rule:\n"
        + "\n".join(cited)
    )


def test_the_citation_check_tells_citations_from_ordinary_words() -> None:
    cited = [
        "SPEC section 4",
        "(SPEC 3: events)",
        "seed: Authority",
        '(seed: "the effective skills")',
        "the seed describes",
        "Context: seed `planner.md`",
        "the seed's Tools table",
        "STYLE rule 5",
        "issue 14",
        "issues #3",
        "Done-when 2",
        "Done when 4",
        "the issue's sizes",
    ]
    for text in cited:
        assert _citations(text), text
    ordinary = [
        "the spec of the tool",
        "a hypothesis seed",
        "seed the demo project",
        "async def test_it(seed: Seed) -> None:",
        "the shared data set in ../shared/data",
        "style of the code",
        "an issue with it",
        "docs/spec/turn-loop.md",
    ]
    for text in ordinary:
        assert not _citations(text), text
