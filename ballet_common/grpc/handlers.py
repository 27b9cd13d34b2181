"""Server interceptors' one way of wrapping a handler: every behaviour (unary or
streaming, by its arity) watched from its start to its status (decisions 0190, 0330s).

``watched(handler, start)`` returns ``handler`` with its one behaviour wrapped: as a call
begins, in the call's own task, ``start()`` runs and returns the function that ends the
watch, called exactly once with the call's status code, the name of the exception that
escaped (``""`` when none did, or for an abort or a cancel) and the call's context.

The status code is ``OK`` (or the code the handler set) when the handler returns, the
code it aborted with, ``CANCELLED`` when the call was cancelled (``CancelledError``, or
``GeneratorExit`` for a stream closed while it yields), ``UNKNOWN`` for an exception
that escaped. A streaming handler that is not an async generator (it writes with
``context.write()`` and returns) is watched as a unary one.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any

import grpc

#: Ends a watch: (status code, escaped exception's type name or "", the call's context).
EndWatch = Callable[[grpc.StatusCode, str, "grpc.aio.ServicerContext[Any, Any]"], None]
#: A call cancelled by the client or the server (a stream closed while it yields).
CANCELLED: tuple[type[BaseException], ...] = (asyncio.CancelledError, GeneratorExit)


def status_code(
    context: grpc.aio.ServicerContext[Any, Any], default: grpc.StatusCode
) -> grpc.StatusCode:
    """The code ``context`` holds (set or aborted with), else ``default``."""
    try:
        code = context.code()
    except Exception:  # the context may be gone with the call; the default stands
        return default
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        for candidate in grpc.StatusCode:
            if candidate.value[0] == code:
                return candidate
    return default


def watched(handler: Any, start: Callable[[], EndWatch]) -> Any:
    """``handler`` (a ``grpc.RpcMethodHandler``) with its behaviour watched by ``start``;
    None stays None."""
    if handler is None:
        return None
    options = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, start), **options)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, start), **options)
    if handler.unary_stream is not None:
        behaviour = _streaming(handler.unary_stream, start)
        return grpc.unary_stream_rpc_method_handler(behaviour, **options)
    if handler.stream_stream is not None:
        behaviour = _streaming(handler.stream_stream, start)
        return grpc.stream_stream_rpc_method_handler(behaviour, **options)
    return handler  # pragma: no cover - every handler has one behaviour


class WatchingInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that watches every call of every method: a subclass says in
    ``start`` what begins a call's watch (``handler_call_details`` has the method's name
    and the call's metadata) and returns what ends it."""

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        return watched(handler, lambda: self.start(handler_call_details))

    def start(self, handler_call_details: Any) -> EndWatch:
        """Begin watching one call (in its task); return the function that ends it."""
        raise NotImplementedError


class _Watch:
    """One call's watch: started on entering, ended on leaving with the call's status."""

    def __init__(self, start: Callable[[], EndWatch], context: Any) -> None:
        self._end = start()
        self._context = context

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        error = ""
        if exc is None:
            code = status_code(self._context, grpc.StatusCode.OK)
        elif isinstance(exc, grpc.aio.AbortError):
            code = status_code(self._context, grpc.StatusCode.UNKNOWN)
        elif isinstance(exc, CANCELLED):
            code = grpc.StatusCode.CANCELLED
        else:
            code, error = grpc.StatusCode.UNKNOWN, type(exc).__qualname__
        self._end(code, error, self._context)


def _unary(behaviour: Callable[..., Any], start: Callable[[], EndWatch]) -> Callable[..., Any]:
    async def watching(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        with _Watch(start, context):
            return await behaviour(request, context)

    return watching


def _streaming(behaviour: Callable[..., Any], start: Callable[[], EndWatch]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behaviour):
        return _unary(behaviour, start)

    async def watching(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        with _Watch(start, context):
            async for response in behaviour(request, context):
                yield response

    return watching
