"""Input files the devstack's importers cannot import: each is
one ``ImportFileError`` line naming the import, the file and the line, never a bare
decoder message (``Expecting value: line 1 column 1``) or a traceback. The parsers touch
no database, so these run without one; ``tests/e2e/test_first_run.py`` runs ``dev``."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.importers.adr import read_adrs
from devstack.importers.beads import parse_export
from devstack.importers.errors import ImportFileError
from devstack.importers.skills import read_skills

GOOD_ROW = b'{"id": "bd-1", "issue_type": "task", "title": "fine"}\n'


def refused(read: object, path: Path) -> str:
    assert callable(read)
    with pytest.raises(ImportFileError) as caught:
        read(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("second_line", "problem"),
    [
        (b"{bad\n", "line 2: not valid JSON (expecting property name"),
        (b"root:x:0:0:root:/root:/bin/bash\n", "line 2: not valid JSON (expecting value"),
        (b'{"id": "caf\xe9"}\n', "line 2: not UTF-8 text"),
        (b"[1, 2]\n", "line 2: not a beads issue"),
        (b'{"title": "no id"}\n', "line 2: not a beads issue"),
        (b'{"id": "bd-2", "issue_type": ["task"]}\n', "line 2: issue 'bd-2': issue_type is"),
        (b'{"id": "bd-2", "labels": "x"}\n', "line 2: issue 'bd-2': labels is not a list"),
        (b'{"id": "bd-2", "dependencies": [7]}\n', "a dependency is not an object"),
        (
            b'{"id": "bd-2", "dependencies": [{"type": "blocks", "depends_on_id": ["bd-1"]}]}\n',
            "a dependency's depends_on_id is not a string",
        ),
    ],
)
def test_a_malformed_tracker_line_is_named(
    tmp_path: Path, second_line: bytes, problem: str
) -> None:
    path = tmp_path / "issues.jsonl"
    path.write_bytes(GOOD_ROW + second_line)
    message = refused(lambda p: parse_export(p, "p"), path)
    assert message.startswith(f"the tracker import failed: {path}, ")
    assert problem in message


def test_a_tracker_file_that_is_a_folder_is_named(tmp_path: Path) -> None:
    message = refused(lambda p: parse_export(p, "p"), tmp_path)
    assert message == f"the tracker import failed: {tmp_path}: cannot read it (is a directory)"


def test_blank_lines_are_skipped_and_good_rows_kept(tmp_path: Path) -> None:
    path = tmp_path / "issues.jsonl"
    path.write_bytes(b"\n" + GOOD_ROW + b"  \n")
    assert [item["item_id"] for item in parse_export(path, "p").items] == ["bd-1"]


def test_a_malformed_adr_is_named_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "0001-first.md").write_text("# 1. First\n\nDate: 2024-01-02\n")
    (tmp_path / "0002-bad-date.md").write_text("# 2. Second\n\nDate: 2024-02-30\n")
    message = refused(read_adrs, tmp_path)
    assert message == (
        f"the knowledge import failed: {tmp_path / '0002-bad-date.md'}, line 3: "
        "Date 2024-02-30 is not a calendar date"
    )
    (tmp_path / "0002-bad-date.md").write_bytes(b"# 2. Second\n\nr\xe9sum\xe9\n")
    assert refused(read_adrs, tmp_path).endswith("0002-bad-date.md, line 3: not UTF-8 text")
    a_file = tmp_path / "0001-first.md"
    assert refused(read_adrs, a_file).endswith("cannot read it (not a directory)")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"no front matter\n", "SKILL.md, line 1: no YAML front matter"),
        (b"---\nname: x\n", "SKILL.md, line 1: the front matter is not closed with ---"),
        (b"---\nname: x\ndescription: [a\n---\n", "line 3: the front matter is not valid YAML"),
        (b"---\n- a list\n---\n", "SKILL.md, line 2: the front matter is not a mapping"),
        (b"---\nname: \xff\n---\n", "SKILL.md, line 2: not UTF-8 text"),
    ],
)
def test_a_malformed_skill_is_named_with_its_line(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "SKILL.md").write_text("---\nname: good\ndescription: d\n---\nbody\n")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "SKILL.md").write_bytes(content)
    message = refused(read_skills, tmp_path)
    assert message.startswith(f"the skills import failed: {tmp_path / 'odd'}")
    assert problem in message
