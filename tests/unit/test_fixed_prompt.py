"""The fixed prompt fits small windows (target T8 of docs/performance.md, decision
0295): the built-in instructions plus the twelve tool declarations, as a compact Chat
Completions ``tools`` array, at most 2,000 ``cl100k_base`` tokens, counted with the real
tokenizer (``bench.cl100k``, a dev dependency); ``python -m bench prompt`` prints the
figures per part."""

from __future__ import annotations

import json
import os

import pytest

from bench import cl100k
from bench.prompt import TARGET_TOKENS, measure, tool_entry, tools_array
from service.core import prompts
from service.core.estimate import MESSAGE_OVERHEAD_TOKENS, declarations_tokens, text_tokens
from service.core.ports import Acting, SkillDocument
from service.core.projects import ProjectDirectory
from service.core.tools import declarations
from service.core.turn.prompt import PromptSource, shared_prefix
from tests.unit.fakes import FakeBackends, FakeClock

#: The estimator's calibrated error bound (decision 0171: within 15 % of cl100k).
ESTIMATE_MARGIN = 1.15


def count(text: str) -> int:
    try:
        return cl100k.count(text)
    except cl100k.TokenizerMissing as missing:
        reason = f"{missing} (pip install -e '.[dev]'); CI=true fails instead of skipping"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def test_the_tokenizer_is_cl100k_base() -> None:
    count("")
    assert cl100k.encoding().encode("hello world") == [15339, 1917]


def test_instructions_and_the_twelve_declarations_fit_2000_cl100k_tokens() -> None:
    offered = declarations()
    assert len(offered) == 12
    total = count(prompts.instructions()) + count(tools_array(offered))
    assert total <= TARGET_TOKENS, f"{total} cl100k_base tokens"


def test_no_declaration_is_larger_than_a_quarter_of_the_target() -> None:
    # propose_changeset alone was 1,139 tokens before decision 0295.
    for declaration in declarations():
        assert count(tool_entry(declaration)) <= TARGET_TOKENS // 4, declaration.name


def test_the_planners_estimate_stays_within_the_target_and_its_margin() -> None:
    # Without a tokenizer (the start-up check, the context estimate) the planner counts
    # with its calibrated estimate, which must not hide a prompt over the target.
    offered = declarations()
    estimate = (
        MESSAGE_OVERHEAD_TOKENS + text_tokens(prompts.instructions()) + declarations_tokens(offered)
    )
    assert estimate <= TARGET_TOKENS * ESTIMATE_MARGIN, estimate


def test_the_bench_counts_every_part_and_the_totals() -> None:
    count("")
    parts = {part.name: part for part in measure()}
    tools = [name for name in parts if name.startswith("tool ")]
    assert len(tools) == 12
    assert parts["instructions + tools"].tokens <= TARGET_TOKENS
    assert parts["project block"].tokens > 0 and parts["skill block"].tokens > 0
    assert parts["fixed prompt"].tokens > parts["instructions + tools"].tokens
    # The array is its entries plus a bracket and a comma each, give or take a merge.
    entries = sum(parts[name].tokens for name in tools)
    assert abs(parts["tools (array)"].tokens - entries) <= 13


def test_a_tool_entry_is_the_declaration_as_sent() -> None:
    declaration = declarations()[0]
    entry = json.loads(tool_entry(declaration))
    assert entry["function"]["parameters"] == json.loads(declaration.parameters_json_schema)


async def test_the_prompt_of_every_project_starts_with_the_same_instructions() -> None:
    # Decision 0296: what differs between projects is in the context, never the system
    # prompt; the same project gives the same context on every turn and session.
    backends = FakeBackends(skill=SkillDocument("planning", "1.2.0", "# Plan\nSmall steps."))
    source = PromptSource(
        ProjectDirectory(backends, FakeClock(), cache_s=0.0), model="m", declarations=declarations()
    )
    alice = Acting(human_id="alice", organization_id="acme", token="t", session_id="s1")
    again = Acting(human_id="alice", organization_id="acme", token="t", session_id="s2")
    first, second = await source.prompt(alice, "demo"), await source.prompt(again, "demo")
    other = await source.prompt(alice, "other")
    assert first.system == second.system == other.system == prompts.instructions()
    assert first.context == second.context != other.context
    assert "- id: demo" in first.context and "- id: other" in other.context
    assert "# Plan" in first.context and "# Plan" not in first.system
    shared = shared_prefix(declarations())
    assert shared.system == first.system
    assert first.fixed_tokens == shared.tokens + MESSAGE_OVERHEAD_TOKENS + text_tokens(
        first.context
    )
