"""The one wrapper around every method handler, built once per method at start-up.

Every handler the server registers (ModelExecutorService, health, reflection) runs inside
one function that does, in this order:

1. observability (service/observability.py): the request id, sent back in the initial
   metadata; the in-flight gauge; at the end, the metrics and the log line of the outcome,
   refusals included;
2. auth (service/auth.py): a call without valid credentials is refused before its bytes are
   parsed; otherwise the caller's identity is set in the handler's own task;
3. parsing and error mapping (service/errors.py): a request that is not a valid protobuf,
   and anything a ModelExecutorService handler raises, become a precise status.

Not grpc.aio interceptors, which run a coroutine each, per call, before the handler is even
known, and rebuilt the chain's wrappers per call under auth: here a call costs one function
frame around its handler (one async generator around a stream's), with nothing allocated
for the method (metric children are bound once).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from service.auth import Authenticator
from service.errors import StatusError, lenient, refusing_undecodable, rich_status, strict, to_status_error
from service.observability import REQUEST_ID, MethodObserver, RpcObservability, remembered, request_id

Handler = grpc.RpcMethodHandler
SERVICE_PREFIX = "/modelexec.v1.ModelExecutorService/"
KINDS = (("unary_unary", grpc.unary_unary_rpc_method_handler),
         ("unary_stream", grpc.unary_stream_rpc_method_handler),
         ("stream_unary", grpc.stream_unary_rpc_method_handler),
         ("stream_stream", grpc.stream_stream_rpc_method_handler))


class CallWrapper:
    """Wraps method handlers (see the module doc); the server asks once per method, at start-up."""

    def __init__(self, observability: RpcObservability, auth: Authenticator | None) -> None:
        self.observability = observability
        self.auth = auth

    def wrap(self, method: str, handler: Handler) -> Handler:
        """The same kind of handler, its behaviour run inside the wrapper."""
        kind, factory = next((k, f) for k, f in KINDS if getattr(handler, k) is not None)
        behaviour = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            behaviour = _on_loop(behaviour)
        streams_requests, streams_responses = kind.startswith("stream"), kind.endswith("stream")
        service = method.startswith(SERVICE_PREFIX)
        m = _Method(
            observer=self.observability.observer(method, streams_responses),
            auth=self.auth if self.auth is not None and self.auth.guards(method) else None,
            # Single requests are parsed in the wrapper, after auth; a stream's messages as they
            # are read, those that do not parse arriving as _Undecodable (StepSession answers
            # them step by step; reflection's stream is refused).
            parse=None if streams_requests else strict(handler.request_deserializer),
            refuse_undecodable=streams_requests and not service,
            # Anything a ModelExecutorService handler raises is mapped; elsewhere only the
            # wrapper's own refusals (auth, parsing).
            map_all=service,
        )
        run = _streaming(m, behaviour) if inspect.isasyncgenfunction(behaviour) else _single(m, behaviour)
        return factory(run, request_deserializer=lenient(handler.request_deserializer) if streams_requests else None,
                       response_serializer=handler.response_serializer)


def _on_loop(sync: Callable[[Any, Any], Any]) -> Any:
    """A synchronous handler, run on the event loop: only the generated stubs of methods a
    servicer leaves out (health's List), which refuse at once."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return sync(request, context)

    return call


class _Method:
    __slots__ = ("auth", "map_all", "observer", "parse", "refuse_undecodable")

    def __init__(self, observer: MethodObserver, auth: Authenticator | None, parse: Callable[[bytes], Any] | None,
                 refuse_undecodable: bool, map_all: bool) -> None:
        self.observer, self.auth, self.parse = observer, auth, parse
        self.refuse_undecodable, self.map_all = refuse_undecodable, map_all

    def request(self, request: Any, metadata: Any, context: grpc.aio.ServicerContext) -> Any:
        """Authenticate, then parse: the request (or request stream) the handler gets."""
        if self.auth is not None:
            self.auth.authenticate(metadata, context)
        if self.parse is not None:
            return self.parse(request)
        return refusing_undecodable(request) if self.refuse_undecodable else request

    def status(self, exc: Exception) -> grpc.Status:
        if not self.map_all and not isinstance(exc, StatusError):
            raise exc
        return rich_status(to_status_error(exc))


def _single(m: _Method, behaviour: Any) -> Any:
    """A method with one response (or, like health's Watch, one that writes its own)."""
    observer = m.observer

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = observer.begin()
        metadata = context.invocation_metadata()
        rid, peer = request_id(metadata), context.peer()
        error = None
        try:
            await context.send_initial_metadata(((REQUEST_ID, rid),))
            try:
                request = m.request(request, metadata, context)
                response = await behaviour(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the one place that maps them all
                await context.abort_with_status(m.status(exc))
            observer.work(request, context)
            return response
        except BaseException as e:
            error = e
            raise
        finally:
            observer.end(rid, peer, context, started, error)

    return call


def _streaming(m: _Method, behaviour: Any) -> Any:
    """A method whose handler is an async generator of responses."""
    observer = m.observer
    steps = observer.step_name is not None

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = observer.begin()
        metadata = context.invocation_metadata()
        rid, peer = request_id(metadata), context.peer()
        error = None
        try:
            await context.send_initial_metadata(((REQUEST_ID, rid),))
            try:
                request = m.request(request, metadata, context)
                # One response per request, in order: StepSession books each step that succeeded.
                pending: collections.deque[Any] = collections.deque()
                async for item in behaviour(remembered(request, pending) if steps else request, context):
                    if steps:
                        step = pending.popleft() if pending else None
                        if step is not None and not item.HasField("error"):
                            observer.step(step)
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - the same mapping as for single responses
                await context.abort_with_status(m.status(exc))
        except BaseException as e:
            error = e
            raise
        finally:
            observer.end(rid, peer, context, started, error)

    return stream


class Registrar:
    """Stands in for the server in the add_*_to_server functions (the generated one,
    health's, reflection's): every method handler they register is wrapped, once."""

    def __init__(self, server: grpc.aio.Server, wrapper: CallWrapper) -> None:
        self._server = server
        self._wrapper = wrapper

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self._wrapper.wrap(f"/{service}/{name}", h) for name, h in handlers.items()})

    def add_generic_rpc_handlers(self, generic_handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_Generic(h, self._wrapper) for h in generic_handlers))


class _Generic(grpc.GenericRpcHandler):
    """A generic handler's methods, wrapped at their first call (registered methods, the
    usual case, never get here)."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrapper: CallWrapper) -> None:
        self._inner = inner
        self._wrapper = wrapper
        self._by_method: dict[str, tuple[Handler, Handler]] = {}

    def service(self, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._inner.service(details)
        if handler is None:
            return None
        cached = self._by_method.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = self._by_method[details.method] = (handler, self._wrapper.wrap(details.method, handler))
        return cached[1]
