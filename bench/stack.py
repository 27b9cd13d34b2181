"""The planner's dependencies for the benchmark, in their own process.

``python -m bench.stack --data-dir DIR --database-url URL --users N --projects M`` starts
the devstack (tracker, skills and knowledge backends on PostgreSQL) with the LLM gateway
on one loopback port, adds the benchmark's humans and projects, and prints
``{"address": "127.0.0.1:PORT"}`` when ready; it runs until SIGTERM.

- Humans ``u000`` .. ``u<N-1>`` of organization ``acme``, each a maintainer of every
  benchmark project: docs/spec/operations.md allows a human 4 running turns and 16 open Chat
  streams, so 100 concurrent sessions and 1,000 idle streams need many humans.
- Projects ``demo`` (the built-in demo project) and ``bench-p1`` .. ``bench-p<M-1>``,
  copies of its items whose planner skill is the organization skill ``ticket-writing``:
  a project runs at most 20 turns at once (docs/spec/limits.md).
- The gateway's model is the scripted provider (devstack/gateway/scripted.py) at zero latency. A
  text delta whose text is ``STAMP`` is sent as ``STAMP<monotonic ns>`` of the moment the
  provider produced it: CLOCK_MONOTONIC is one clock for every process of the machine,
  so the driver can tell how long a delta took to reach it through the planner.

A small control service (``/bench.Control/...``, raw JSON bytes) lets the driver set the
scenario and read counters: model calls by purpose and backend calls by method since
the last reset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import sqlalchemy as sa
from ballet.llm.v1 import gateway_pb2
from sqlalchemy.ext.asyncio import AsyncSession

from ballet_common.tokens import Trust, dev_secret
from devstack.gateway.base import ProviderChunk, TextChunk
from devstack.gateway.scripted import ScriptedProvider
from devstack.gateway.service import GatewayServicer, add_gateway_service
from devstack.importers.beads import upsert_items
from devstack.server import DevStack, DevStackConfig
from devstack.store.access import put_project
from devstack.store.schema import dependencies, items, project_roles, users

CONTROL = "bench.Control"
STAMP = "@t"
ORGANIZATION = "acme"
#: The organization skill every acme project sees, used as the copies' planner skill.
COPY_PLANNER_SKILL = "ticket-writing"


def human_id(index: int) -> str:
    """The id of benchmark human ``index``."""
    return f"u{index:03d}"


def project_ids(count: int) -> list[str]:
    """The benchmark's projects: ``demo`` first, then its copies."""
    return ["demo", *(f"bench-p{i}" for i in range(1, count))]


class StampingProvider:
    """The scripted provider, counting calls by purpose and stamping ``STAMP`` deltas."""

    def __init__(self, inner: ScriptedProvider) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        self.calls[
            "compaction" if request.purpose == gateway_pb2.PURPOSE_COMPACTION else "turn"
        ] += 1
        async for chunk in self.inner.generate(request):
            if isinstance(chunk, TextChunk) and chunk.text == STAMP:
                chunk = TextChunk(f"{STAMP}{time.monotonic_ns()}")
            yield chunk


class Control:
    """The control service's state: the provider, the gateway servicer, the devstack."""

    def __init__(self, provider: StampingProvider) -> None:
        self.provider = provider
        self.gateway: GatewayServicer | None = None
        self.stack: DevStack | None = None

    async def set_scenario(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        self.provider.inner.set_scenario(json.loads(request))
        return b"{}"

    async def stats(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        assert self.stack is not None and self.gateway is not None
        calls = Counter(record.method for record in self.stack.call_log.records)
        answer = {"model": dict(self.provider.calls), "calls": dict(calls)}
        if request == b"reset":
            self.provider.calls.clear()
            self.stack.call_log.clear()
        # The servicer keeps every request for tests; a benchmark makes tens of thousands.
        self.gateway.requests.clear()
        return json.dumps(answer).encode()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            CONTROL,
            {
                "SetScenario": grpc.unary_unary_rpc_method_handler(self.set_scenario),
                "Stats": grpc.unary_unary_rpc_method_handler(self.stats),
            },
        )


async def seed(stack: DevStack, *, humans: int, projects: int) -> None:
    """Add the benchmark's humans and project copies (see the module docstring)."""

    async def work(session: AsyncSession) -> None:
        demo_items = [
            dict(row)
            for row in (
                await session.execute(sa.select(items).where(items.c.project_id == "demo"))
            ).mappings()
        ]
        demo_deps = [
            dict(row)
            for row in (
                await session.execute(
                    sa.select(dependencies).where(dependencies.c.project_id == "demo")
                )
            ).mappings()
        ]
        for project_id in project_ids(projects)[1:]:
            await put_project(
                session,
                project_id=project_id,
                org_id=ORGANIZATION,
                name=f"Pantry copy {project_id}",
                description="A copy of the demo project for the benchmark.",
                settings={
                    "planner.skill": COPY_PLANNER_SKILL,
                    "planner.model_credential": "bench-credential",
                },
            )
            await upsert_items(
                session,
                [{**row, "project_id": project_id} for row in demo_items],
                org_id=ORGANIZATION,
            )
            if demo_deps:
                await session.execute(
                    sa.insert(dependencies),
                    [{**row, "project_id": project_id} for row in demo_deps],
                )
        await session.execute(
            sa.insert(users),
            [
                {"user_id": human_id(i), "org_id": ORGANIZATION, "name": f"Bench {i}"}
                for i in range(humans)
            ],
        )
        await session.execute(
            sa.insert(project_roles),
            [
                {"project_id": project_id, "user_id": human_id(i), "role": "maintainer"}
                for project_id in project_ids(projects)
                for i in range(humans)
            ],
        )

    await stack.store.run_write(work)


async def serve(args: argparse.Namespace) -> None:
    """Start the stack, seed it, print the address, and run until SIGTERM."""
    provider = StampingProvider(ScriptedProvider([]))
    control = Control(provider)

    trust = Trust.dev(dev_secret(args.data_dir))

    def extra(server: grpc.aio.Server) -> None:
        control.gateway = add_gateway_service(server, provider, trust=trust)
        server.add_generic_rpc_handlers((control.handler(),))

    stack = await DevStack.start(
        DevStackConfig(
            data_dir=args.data_dir,
            database_url=args.database_url,
            address="127.0.0.1:0",
            extra_services=extra,
            extra_service_names=(CONTROL,),
        )
    )
    control.stack = stack
    await seed(stack, humans=args.users, projects=args.projects)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps({"address": stack.address}), flush=True)
    try:
        await stop.wait()
    finally:
        await stack.stop(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stack")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--users", type=int, default=101)
    parser.add_argument("--projects", type=int, default=10)
    args = parser.parse_args(argv)
    # The devstack and gateway log every call at INFO; the benchmark reads counters.
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
