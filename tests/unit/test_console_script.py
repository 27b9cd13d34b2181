"""The ``ballet-planner`` console script at its edges (found by a new-user trial): a
Ctrl-C while it still loads its modules, and a reader that left (``| head``), end it
quietly (exit 130; 1, as ``chat`` when its reader left), with no traceback."""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

import pytest

from service import launch
from tests.e2e.dev_support import clean_env, command


class InterruptingImport(importlib.abc.MetaPathFinder):
    """Raises ``KeyboardInterrupt`` when ``service.cli`` is imported: a Ctrl-C that
    lands while the command loads."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == "service.cli":
            raise KeyboardInterrupt
        return None


def test_a_ctrl_c_while_the_command_loads_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "service.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [InterruptingImport(), *sys.meta_path])
    assert launch.main() == 130


def test_output_to_a_reader_that_left_ends_with_1_and_no_traceback(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the first line: every write fails
    token = ["token", "--user", "alice", "--data-dir", str(tmp_path), "--create-secret"]
    try:
        result = subprocess.run(
            [*command(), *token],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert result.stderr == ""
