"""Scripted-model scenarios of the benchmark (devstack/gateway/scripted.py format), zero latency.

One scenario serves every phase: the human message's first word picks the behaviour.

- ``round ...``: a turn of ``rounds`` rounds; each round is one model answer with one
  ``get_item`` call (a tracker ``GetItem``), then a short final answer (T1, T2, T3, T4).
- ``ttfd``: a one-delta answer ``STAMP`` that the stack stamps with its emit time (T6).
- ``long``: a long answer split into ``long_deltas`` deltas of ``long_chunk`` characters
  (T6 pass-through).

Every answer reports usage, so the context estimate stays at the reported tokens and
no compaction runs (these are not compaction benchmarks).
"""

from __future__ import annotations

from typing import Any

from bench.stack import STAMP

USAGE = {"input_tokens": 1200, "output_tokens": 40}
ITEM_ID = "PAN-9"


def scenario(*, rounds: int = 1, long_deltas: int = 1000, long_chunk: int = 16) -> dict[str, Any]:
    """The scenario; ``rounds`` >= 1 rounds per ``round`` turn."""
    if rounds < 1:
        raise ValueError("a round turn has at least one round")
    call = {"name": "get_item", "arguments": {"item_id": ITEM_ID}}
    rules: list[dict[str, Any]] = [
        {
            "comment": "T6: time to first delta",
            "match": {"purpose": "turn", "last_role": "human", "last_text_regex": "^ttfd"},
            "reply": {"text": STAMP, "usage": USAGE},
        },
        {
            "comment": "T6: a long answer in many deltas",
            "match": {"purpose": "turn", "last_role": "human", "last_text_regex": "^long"},
            "reply": {
                "text": "x" * (long_deltas * long_chunk),
                "chunk_chars": long_chunk,
                "usage": USAGE,
            },
        },
        {
            "comment": "round turns: the first round",
            "match": {"purpose": "turn", "last_role": "human"},
            "reply": {"tool_calls": [call], "usage": USAGE},
        },
    ]
    for done in range(1, rounds):
        rules.append(
            {
                "comment": f"round turns: round {done + 1}",
                "match": {"purpose": "turn", "last_role": "tool", "tool_results_in_turn": done},
                "reply": {"tool_calls": [call], "usage": USAGE},
            }
        )
    rules.append(
        {
            "comment": "round turns: the final answer",
            "match": {"purpose": "turn", "last_role": "tool"},
            "reply": {"text": f"{ITEM_ID} is open: the session lifetime bug.", "usage": USAGE},
        }
    )
    rules.append(
        {
            "comment": "never expected: the estimate stays below the threshold",
            "match": {"purpose": "compaction"},
            "reply": {"text": "Summary of the earlier conversation.", "usage": USAGE},
        }
    )
    return {"comment": "bench scenario", "rules": rules}
