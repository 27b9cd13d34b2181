"""The generated-code check CI runs: ``scripts/generate.py --check``
passes on the committed tree and fails once a proto changes without regenerating."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _copy_tree(target: Path) -> None:
    for name in ("proto", "third_party", "scripts", "generated"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_generated_code_is_current(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    result = _check(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "up to date" in result.stdout


def test_a_changed_proto_without_regeneration_fails_the_check(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    proto = tmp_path / "proto" / "ballet" / "planner" / "v1" / "resources.proto"
    text = proto.read_text()
    marker = "  string running_turn_id = 11;\n"
    assert marker in text
    proto.write_text(
        text.replace(
            marker, marker + "  // A field added without regenerating.\n  string extra = 12;\n"
        )
    )
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "generated/ is stale" in result.stdout
    assert "resources_pb2.py (differs)" in result.stdout
