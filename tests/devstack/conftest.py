"""Fixtures of the devstack tests.

LLM gateway (tests/devstack/test_gateway_*): `start_gateway` and `llm_streams_dir`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from devstack.gateway import Provider
from tests.devstack.gateway_support import GatewayHarness, start_harness


@pytest.fixture
async def start_gateway() -> AsyncIterator[Callable[[Provider], Awaitable[GatewayHarness]]]:
    """Start gateway servers (real grpc.aio, 127.0.0.1, port 0); all stop at teardown."""
    started: list[tuple[grpc.aio.Server, grpc.aio.Channel]] = []

    async def start(provider: Provider) -> GatewayHarness:
        harness, server, channel = await start_harness(provider)
        started.append((server, channel))
        return harness

    yield start
    for server, channel in started:
        await channel.close()
        await server.stop(None)


@pytest.fixture(scope="session")
def llm_streams_dir(shared_data: Path) -> Path:
    """`llm-streams` in the shared data folder, the recorded model streams (skips when absent,
    fails with BALLET_REQUIRE_SHARED_DATA=1, as `shared_data` does)."""
    return shared_data / "llm-streams"
