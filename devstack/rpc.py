"""What every devstack RPC does around its own work: faults, identity, errors and the record.

``Backend.run`` is the one place where a call is authenticated (docs/spec/authority.md), delayed
or failed by the fault injector, recorded in the ``CallLog``, and where a
``BackendError`` becomes a ``google.rpc.Status`` with one ``ErrorInfo`` (AIP-193) sent with
``abort_with_status``. Servicer methods only convert requests and results.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ballet_common.grpc.status import RpcFailure
from devstack.auth import Authenticator, Caller
from devstack.calls import CallLog, CallRecord
from devstack.errors import BackendError, Internal
from devstack.faults import FaultInjector

R = TypeVar("R")

log = logging.getLogger(__name__)


def rich_status(error: BackendError, domain: str) -> grpc.Status:
    """``error`` as a gRPC status whose details hold exactly one ``ErrorInfo``."""
    return RpcFailure(
        grpc.StatusCode[error.code], error.message, error.reason, domain, error.metadata
    ).to_grpc_status()


class Backend:
    """The shared RPC plumbing of one backend service (one audience, one error domain)."""

    def __init__(
        self,
        *,
        service: str,
        domain: str,
        authenticator: Authenticator,
        calls: CallLog,
        faults: FaultInjector,
    ) -> None:
        self.service = service
        self.domain = domain
        self._authenticator = authenticator
        self._calls = calls
        self._faults = faults

    def note_write(self, request_id: str) -> None:
        """Count one real (not replayed) write for ``request_id`` in the call log."""
        self._calls.note_write(request_id)

    async def run(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        method: str,
        work: Callable[[Caller], Awaitable[R]],
        *,
        project_id: str = "",
        request_id: str = "",
    ) -> R:
        """Authenticate, apply faults, run ``work(caller)``, record the call, map errors.

        ``context`` is the ``grpc.aio.ServicerContext``. A refused call ends in
        ``context.abort_with_status`` (which raises ``grpc.aio.AbortError``); a cancelled
        one (client gone or deadline passed) is recorded and re-raised.
        """
        started = time.time()
        self._calls.note_started(method)
        identified = self._authenticator.identify(context.invocation_metadata() or ())
        caller = identified.caller

        def record(code: grpc.StatusCode, reason: str = "") -> None:
            self._calls.add(
                CallRecord(
                    service=self.service,
                    method=method,
                    human=caller.human if caller else "",
                    actor=caller.actor if caller else "",
                    actor_header=identified.actor_header,
                    request_id=request_id,
                    project_id=project_id,
                    code=code,
                    reason=reason,
                    start_time=started,
                    duration_s=time.time() - started,
                )
            )

        try:
            await self._faults.apply(self.service, method)
            if identified.error is not None:
                raise identified.error
            assert caller is not None
            result = await work(caller)
        except BackendError as error:
            record(grpc.StatusCode[error.code], error.reason)
            await context.abort_with_status(rich_status(error, self.domain))
            raise AssertionError("abort_with_status returned") from error
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            record(grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED)
            raise
        except Exception as error:
            log.exception("%s/%s failed", self.service, method)
            record(grpc.StatusCode.INTERNAL, "INTERNAL")
            internal = Internal("INTERNAL", f"internal error: {type(error).__name__}")
            await context.abort_with_status(rich_status(internal, self.domain))
            raise AssertionError("abort_with_status returned") from error
        record(grpc.StatusCode.OK)
        return result
