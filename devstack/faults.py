"""Faults the tests inject into the devstack backends at run time: delays and errors.

The planner's tests use them to make a tool backend exceed its deadline, fail with
``UNAVAILABLE`` a few times (retries, docs/spec/turn-loop.md) or fail for good. A rule applies to
one RPC name (``GetItem``) or to every RPC of a service (``ballet.tracker.v1.TrackerService``
or its short name ``TrackerService``); a method rule wins over a service rule.

A delay is interruptible: ``clear()`` releases calls still waiting, so a test that parks
calls with ``delay_s=math.inf`` can let them go without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field

import grpc

from devstack.errors import Injected


@dataclass
class Fault:
    """One rule: ``delay_s`` seconds before the call runs (``math.inf``: until cleared),
    then, when ``code`` is set, the call fails with that status, ``reason`` and ``message``.
    ``times`` is how many calls it still applies to (None: until cleared)."""

    delay_s: float = 0.0
    code: grpc.StatusCode | None = None
    reason: str = "INJECTED_FAULT"
    message: str = "fault injected by the devstack"
    times: int | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event, repr=False)


class FaultInjector:
    """Per-method and per-service fault rules, changed at run time by tests."""

    def __init__(self) -> None:
        self._by_method: dict[str, Fault] = {}
        self._by_service: dict[str, Fault] = {}

    def set(
        self,
        *,
        method: str | None = None,
        service: str | None = None,
        delay_s: float = 0.0,
        error: grpc.StatusCode | None = None,
        reason: str = "INJECTED_FAULT",
        message: str = "fault injected by the devstack",
        times: int | None = None,
    ) -> None:
        """Add or replace the rule of ``method`` (an RPC name) or ``service``.

        Exactly one of ``method`` and ``service`` is required. Raises ``ValueError`` for a
        negative delay, ``times`` below 1, or ``error=grpc.StatusCode.OK``.
        """
        if (method is None) == (service is None):
            raise ValueError("give exactly one of method and service")
        if delay_s < 0 or math.isnan(delay_s):
            raise ValueError("delay_s must be >= 0")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1")
        if error is grpc.StatusCode.OK:
            raise ValueError("an injected error cannot be OK")
        rule = Fault(delay_s=delay_s, code=error, reason=reason, message=message, times=times)
        table, key = self._table(method, service)
        old = table.get(key)
        if old is not None:
            old.released.set()
        table[key] = rule

    def clear(self, *, method: str | None = None, service: str | None = None) -> None:
        """Remove the rule of ``method`` or ``service``, or every rule when neither is given.

        Calls still waiting out a removed rule's delay proceed at once.
        """
        if method is None and service is None:
            rules = [*self._by_method.values(), *self._by_service.values()]
            self._by_method.clear()
            self._by_service.clear()
        else:
            table, key = self._table(method, service)
            rule = table.pop(key, None)
            rules = [] if rule is None else [rule]
        for rule in rules:
            rule.released.set()

    async def apply(self, service: str, method: str) -> None:
        """Run the rule for this call, if any: wait its delay, then raise its error.

        Raises ``devstack.errors.Injected`` carrying the rule's code and reason.
        """
        rule = self._by_method.get(method)
        table, key = self._by_method, method
        if rule is None:
            short = service.rsplit(".", 1)[-1]
            rule = self._by_service.get(service) or self._by_service.get(short)
            table, key = self._by_service, service if service in self._by_service else short
        if rule is None:
            return
        if rule.times is not None:
            rule.times -= 1
            if rule.times <= 0 and table.get(key) is rule:
                del table[key]
        if rule.delay_s > 0:
            timeout = None if math.isinf(rule.delay_s) else rule.delay_s
            # The delay ends early when a test clears the rule.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rule.released.wait(), timeout)
        if rule.code is not None:
            raise Injected(rule.code.name, rule.reason, rule.message)

    def _table(self, method: str | None, service: str | None) -> tuple[dict[str, Fault], str]:
        if method is not None:
            return self._by_method, method
        assert service is not None
        return self._by_service, service
