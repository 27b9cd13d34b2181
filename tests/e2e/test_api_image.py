"""``buf breaking`` runs against the committed API image:
``scripts/api_image.py --check`` passes on the committed tree, fails once a field is
renamed, and accepts an added field (AIP-180: additions only)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.e2e.dev_support import find_buf

ROOT = Path(__file__).resolve().parents[2]
CHAT = Path("proto/ballet/planner/v1/chat.proto")


def _copy_tree(target: Path) -> None:
    for name in ("proto", "third_party", "scripts", "api"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "buf.yaml", target / "buf.yaml")


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    find_buf()  # skips (or fails in CI) without buf
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "api_image.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _edit(root: Path, old: str, new: str) -> None:
    path = root / CHAT
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_the_tree_is_compatible_with_the_committed_image(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    result = _check(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_renamed_field_breaks(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    _edit(tmp_path, "  string model = 1;", "  string model_name = 1;")
    result = _check(tmp_path)
    assert result.returncode != 0
    assert 'changed name from "model" to "model_name"' in result.stdout


def test_an_added_field_does_not_break(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    _edit(
        tmp_path,
        "  int32 max_rounds = 2;\n",
        "  int32 max_rounds = 2;\n  // A field added in a later release.\n  string extra = 3;\n",
    )
    result = _check(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
