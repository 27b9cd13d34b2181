"""The built-in planner instructions and summary instructions, versioned text.

A change of wording is a new file (``instructions-vN.md``), so each turn records exactly
which text the model saw (docs/spec/turn-loop.md step 2).
"""

from __future__ import annotations

from importlib import resources

INSTRUCTIONS_VERSION = "v3"
SUMMARY_VERSION = "v2"


def instructions() -> str:
    """The built-in planner instructions of ``INSTRUCTIONS_VERSION``."""
    return _read(f"instructions-{INSTRUCTIONS_VERSION}.md")


def summary_instructions() -> str:
    """The default compaction instructions (``planner.summary_instructions`` overrides)."""
    return _read(f"summary-{SUMMARY_VERSION}.md")


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8").strip()
