"""Helpers for interceptors that wrap a method's handler in behaviour of their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Handler = grpc.RpcMethodHandler


def wrap_handler(handler: Handler, around: Callable[[Any], Any], request_deserializer: Any = ...) -> Handler:
    """The same kind of handler, its behaviour function replaced by `around(behaviour)`."""
    deserializer = handler.request_deserializer if request_deserializer is ... else request_deserializer
    for kind, factory in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                          ("unary_stream", grpc.unary_stream_rpc_method_handler),
                          ("stream_unary", grpc.stream_unary_rpc_method_handler),
                          ("stream_stream", grpc.stream_stream_rpc_method_handler)):
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return factory(around(behaviour), request_deserializer=deserializer,
                           response_serializer=handler.response_serializer)
    return handler


class WrappedHandlers:
    """An interceptor's wrapped handlers, by method, rebuilt only when the handler beneath
    changes (a per-call one, such as auth's). A call then costs the interceptor one dict
    lookup instead of new closures and a new handler: ~0.1 ms of CPU per call here."""

    def __init__(self, wrap: Callable[[str, Handler], Handler]) -> None:
        self._wrap = wrap
        self._by_method: dict[str, tuple[Handler, Handler]] = {}  # registered methods only: bounded

    def get(self, method: str, handler: Handler) -> Handler:
        cached = self._by_method.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, self._wrap(method, handler))
            self._by_method[method] = cached
        return cached[1]
