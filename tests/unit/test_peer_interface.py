"""The names the peer benchmark (the team's ``peerbench`` tool, docs/performance.md T7)
imports from this project stay importable: it runs LangGraph and the Agents SDK on the
planner's own request shapes and tool results, so a rename here would break the
comparison silently until the next benchmark run.

Its token and credential imports (``service.tokens``, ``service.server.credentials``) are not
kept: the token code moved to ``ballet_common.tokens`` and gave the planner one
credential per dependency, which each dependency alone accepts (decisions 0153, 0157), so
the benchmark's single credential for the gateway and the tracker must change with it.
"""

from __future__ import annotations

import importlib

import pytest
from ballet.tracker.v1 import tracker_pb2

NAMES = {
    "service.adapters.backends": (
        "ACTOR_HEADER",
        "MODEL_CREDENTIAL_SETTING",
        "PLANNER_SKILL_SETTING",
        "SERVICE_AUTHORIZATION_HEADER",
        "_full_item",
    ),
    "ballet_common.grpc.channels": ("make_channel",),
    "service.core.context": ("build_system_prompt",),
    "service.core.ports": ("ProjectInfo", "SkillDocument"),
    "service.core.tools": ("TOOLS", "declarations"),
    "ballet_common.tokens": (
        "DEV_ISSUER",
        "PLANNER_AUDIENCE",
        "KeySet",
        "TokenError",
        "TokenVerifier",
        "bearer",
        "dev_secret",
    ),
    "bench.stack": ("CONTROL", "Control", "StampingProvider", "seed"),
    "devstack.gateway.scripted": ("ScriptedProvider",),
    "devstack.gateway.service": ("add_gateway_service",),
    "devstack.server": ("DevStack", "DevStackConfig"),
}


@pytest.mark.parametrize("module", sorted(NAMES))
def test_the_peer_benchmarks_imports_exist(module: str) -> None:
    loaded = importlib.import_module(module)
    missing = [name for name in NAMES[module] if not hasattr(loaded, name)]
    assert missing == []


def test_full_item_is_the_get_item_tools_shape() -> None:
    from service.adapters.backends import _full_item

    item = tracker_pb2.Item(item_id="PAN-9", title="Stock", description="d")
    shown = _full_item(item)
    assert shown["item_id"] == "PAN-9" and shown["description"] == "d"
    assert "blocked_by_ids" in shown
