"""Output caps and turn budgets (decision 0291; docs/spec/turn-loop.md, "Output
caps and turn budgets"), on the turn loop with a scripted model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.core.model import MessageKind, TurnEndReason
from service.core.ports import FinishReason, ModelRequest, Purpose, Role
from service.core.turn.model_call import MIN_OUTPUT_TOKENS
from tests.unit.fakes import last_role
from tests.unit.test_turn_steps import make


def reads_forever(request: ModelRequest) -> dict[str, Any]:
    return {"tool_calls": [("list_runnable", "{}")], "usage": (3000, 100)}


async def test_every_turn_call_carries_the_configured_output_cap() -> None:
    rig = make(lambda r: {"text": "hello"}, max_output_tokens=300)
    await rig.run("Say hello in five words.")
    assert [r.max_output_tokens for r in rig.gateway.requests] == [300]


async def test_the_cap_is_what_the_window_has_left_after_the_request() -> None:
    rig = make(lambda r: {"text": "hello"}, model_context_tokens=2600, max_output_tokens=4096)
    await rig.run("hi")
    request = rig.gateway.requests[0]
    assert request.input_estimate > 0
    assert request.max_output_tokens == max(MIN_OUTPUT_TOKENS, 2600 - request.input_estimate)


async def test_a_runaway_answer_stopped_at_the_cap_ends_output_limit_and_is_shown_cut() -> None:
    rig = make(lambda r: {"chunks": ["la ", "la ", "la"], "finish": FinishReason.LENGTH})
    turn_id = await rig.run("Say hello in five words.")
    end = rig.end(turn_id)
    assert end.ending.reason is TurnEndReason.OUTPUT_LIMIT
    assert end.ending.error_reason == "OUTPUT_LIMIT"
    answer = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.ASSISTANT][-1]
    assert answer.cut and answer.finish_reason == "length" and answer.text == "la la la"


async def test_the_token_budget_ends_the_turn_before_the_call_that_would_exceed_it() -> None:
    # Each call reports 3,000 in and 100 out. With 8,000 for the turn, the second call's
    # request (about 3,100 + its new messages) leaves less than 2,048 for its answer: its
    # cap is what the budget had left; the third call would not fit, so it is never made.
    rig = make(reads_forever, max_rounds=10, turn_max_tokens=8000, max_output_tokens=2048)
    turn_id = await rig.run("go")
    end = rig.end(turn_id)
    assert end.ending.reason is TurnEndReason.BUDGET_EXHAUSTED
    assert end.ending.error_reason == "TURN_BUDGET_TOKENS"
    requests = rig.gateway.requests
    assert len(requests) == 2
    first, last = requests
    assert first.max_output_tokens == 2048
    assert last.max_output_tokens == 8000 - 3100 - last.input_estimate
    assert last.max_output_tokens < 2048
    assert rig.names(turn_id)[-1] == "End"


async def test_the_model_request_budget_counts_every_call() -> None:
    rig = make(reads_forever, max_rounds=10, turn_max_model_requests=3)
    turn_id = await rig.run("go")
    end = rig.end(turn_id)
    assert end.ending.reason is TurnEndReason.BUDGET_EXHAUSTED
    assert end.ending.error_reason == "TURN_BUDGET_MODEL_REQUESTS"
    assert len(rig.gateway.requests) == 3


async def test_tool_calls_past_the_budget_get_an_error_result_and_end_the_turn() -> None:
    def three_reads(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER:
            return {"tool_calls": [("get_item", f'{{"item_id": "PAN-{i}"}}') for i in range(3)]}
        return {"text": "done"}

    rig = make(three_reads, max_rounds=10, turn_max_tool_calls=2)
    turn_id = await rig.run("go")
    end = rig.end(turn_id)
    assert end.ending.reason is TurnEndReason.BUDGET_EXHAUSTED
    assert end.ending.error_reason == "TURN_BUDGET_TOOL_CALLS"
    assert len(rig.backends.calls) == 2
    results = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.TOOL_RESULT]
    assert sum("TURN_BUDGET_TOOL_CALLS" in m.tool_result for m in results) == 1
    assert len(rig.gateway.requests) == 1


async def test_compaction_calls_carry_their_own_cap_and_count_in_the_budget() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            return {"text": "The human asked about many items; all were listed. " * 5}
        return {"text": "ok", "usage": (50, 5)}

    rig = make(script, compact_at_tokens=1, compaction_max_output_tokens=500)
    await rig.run("first question " * 50)
    await rig.run("second question")
    purposes = [(r.purpose, r.max_output_tokens) for r in rig.gateway.requests]
    assert (Purpose.COMPACTION, 500) in purposes
    assert all(cap > 0 for _, cap in purposes)


def test_the_start_up_check_counts_the_fixed_prompt_as_rendered() -> None:
    from service.config import ConfigError, PlannerSettings, check_context_budget
    from service.core.tools import declarations
    from service.core.turn.prompt import shared_prefix

    fixed = shared_prefix(declarations()).tokens
    assert fixed > 1000
    # A window the fixed prompt and one capped answer do not fit is refused, naming keys.
    small = PlannerSettings(
        model_context_tokens=fixed + 1024,
        max_output_tokens=1500,
        compact_at_tokens=1,
        max_rounds=1,
        tool_result_max_bytes=1024,
        compaction_input_max_tokens=1024,
    )
    with pytest.raises(ConfigError) as refused:
        check_context_budget(small, fixed)
    assert "planner.model_context_tokens" in str(refused.value)
    assert "planner.max_output_tokens" in str(refused.value)
    check_context_budget(small)  # the loader's check alone, without the prompt, passed it
    # The whole budget counts the fixed prompt and the cap too.
    tight = PlannerSettings(
        model_context_tokens=8192,
        compact_at_tokens=8192 - 5120 - 2048,
        max_rounds=1,
        max_output_tokens=2048,
        compaction_input_max_tokens=4096,
    )
    check_context_budget(tight)
    with pytest.raises(ConfigError, match=r"the fixed prompt .* plus planner.max_output_tokens"):
        check_context_budget(tight, fixed)
    # The defaults fit with the rendered prompt.
    check_context_budget(PlannerSettings(), fixed)


async def test_serve_refuses_a_window_the_fixed_prompt_does_not_fit(tmp_path: Path) -> None:
    """Done at start-up, before the database is opened or a port bound (decision 0293):
    a 3 K window passes the loader's own check but not the rendered prompt's."""
    from service.config import ConfigError
    from service.server.root import start_planner
    from tests.service.planner_support import planner_settings

    settings = planner_settings(
        tmp_path,
        "127.0.0.1:1",
        PLANNER__MODEL_CONTEXT_TOKENS="3000",
        PLANNER__MAX_OUTPUT_TOKENS="1500",
        PLANNER__COMPACT_AT_TOKENS="1",
        PLANNER__MAX_ROUNDS="1",
        PLANNER__TOOL_RESULT_MAX_BYTES="1024",
        PLANNER__COMPACTION_INPUT_MAX_TOKENS="1024",
    )
    with pytest.raises(ConfigError, match=r"planner\.model_context_tokens"):
        await start_planner(settings)
    assert not (tmp_path / "planner.db").exists()
