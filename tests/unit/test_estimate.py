"""The calibrated token estimator against cl100k (decision 0171).

The reference counts were made once with tiktoken's cl100k_base and are kept beside the
samples (``token_samples/README.md`` says how); here the estimator must stay within 15%
of each, and of each class's total.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.core.estimate import (
    CALIBRATION_MAX,
    CALIBRATION_WEIGHT,
    MESSAGE_OVERHEAD_TOKENS,
    TOOL_CALL_OVERHEAD_TOKENS,
    TokenCalibration,
    declarations_tokens,
    message_tokens,
    text_tokens,
)
from service.core.model import Message, MessageKind
from service.core.tools import declarations

SAMPLES = Path(__file__).parent / "token_samples"
REFERENCE = json.loads((SAMPLES / "reference_counts.json").read_text(encoding="utf-8"))
#: The classes the estimate must hold to; the reference holds more.
REQUIRED = {"English prose", "JSON tool output", "Python code", "Chinese prose", "Japanese prose"}


def sample(name: str) -> str:
    return (SAMPLES / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(REFERENCE["samples"]))
def test_each_sample_is_within_15_percent_of_cl100k(name: str) -> None:
    expected = REFERENCE["samples"][name]["cl100k_tokens"]
    assert text_tokens(sample(name)) == pytest.approx(expected, rel=0.15)


def test_each_class_is_within_15_percent_of_cl100k_and_the_required_ones_are_there() -> None:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, entry in REFERENCE["samples"].items():
        totals[entry["class"]][0] += text_tokens(sample(name))
        totals[entry["class"]][1] += entry["cl100k_tokens"]
    assert set(totals) >= REQUIRED
    for kind, (estimate, expected) in totals.items():
        assert estimate == pytest.approx(expected, rel=0.15), kind


def test_the_samples_are_the_ones_counted() -> None:
    """A sample edited after the counts were made would test nothing."""
    for name, entry in REFERENCE["samples"].items():
        text = sample(name)
        assert (len(text), len(text.encode())) == (entry["characters"], entry["utf8_bytes"])


def test_cjk_costs_about_a_token_a_character_where_bytes_over_four_would_undercount() -> None:
    text = "拆分搜索史诗把排序相关的工单移到夏季里程碑" * 10
    assert text_tokens(text) >= len(text)
    assert len(text.encode()) / 4 < 0.8 * text_tokens(text)


def test_empty_text_costs_nothing_and_a_compaction_marker_is_not_sent() -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    assert text_tokens("") == 0
    marker = Message("s", "t", "m", MessageKind.COMPACTION, now, up_to=3, estimated_tokens=9)
    assert message_tokens(marker) == 0
    human = Message("s", "t", "m", MessageKind.HUMAN, now, text="hello world")
    assert message_tokens(human) == MESSAGE_OVERHEAD_TOKENS + text_tokens("hello world")
    call = Message("s", "t", "m", MessageKind.TOOL_CALL, now, tool_name="get_item",
                   tool_call_id="call_1", tool_arguments='{"item_id":"PAN-4"}')  # fmt: skip
    assert message_tokens(call) > MESSAGE_OVERHEAD_TOKENS + TOOL_CALL_OVERHEAD_TOKENS


def test_the_twelve_tool_declarations_are_well_over_a_thousand_tokens() -> None:
    """The fixed part of every request the estimate must never leave out
    (docs/spec/compaction.md); lean since decision 0295 (about 1,700 estimated)."""
    assert 1_200 < declarations_tokens(declarations()) < 2_300


def test_the_calibration_learns_the_models_count_between_one_and_twice_the_estimate() -> None:
    """Decision 0350: the first reading sets the factor, later ones move it by
    ``CALIBRATION_WEIGHT``; it never goes below 1 (a low estimate overflows the window)
    nor above ``CALIBRATION_MAX``."""
    calibration = TokenCalibration()
    assert calibration.scale(1_000) == 1_000
    calibration.observe(2_000, 2_700)
    assert calibration.factor == pytest.approx(1.35)
    assert calibration.scale(2_000) == 2_700
    calibration.observe(1_000, 1_000)
    assert calibration.factor == pytest.approx(1.35 + (1.0 - 1.35) * CALIBRATION_WEIGHT)
    # A server that dropped the tools reports far less: it pulls towards 1, never below.
    dropped = TokenCalibration()
    dropped.observe(2_000, 600)
    assert dropped.factor == 1.0
    # A reading beyond twice the estimate is capped; nothing reported teaches nothing.
    wild = TokenCalibration()
    wild.observe(1_000, 9_000)
    wild.observe(0, 500)
    wild.observe(500, 0)
    assert (wild.factor, wild.readings) == (CALIBRATION_MAX, 1)
