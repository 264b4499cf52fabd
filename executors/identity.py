"""The identity of the caller on whose behalf executor work runs.

The service's call wrapper (service.handlers) sets it per RPC (from a bearer token or a client
certificate); executors read it to tie each cache to the identity that created it. None
means authentication is off: every caller is the same anonymous identity.
"""

from __future__ import annotations

from contextvars import ContextVar

current_identity: ContextVar[str | None] = ContextVar("current_identity", default=None)
