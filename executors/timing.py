"""Per-call timing, collected without threading it through every signature.

The service puts a CallTimer in a context variable before it calls the executor; the
worker adds its queue and run times to whichever timer is current in the calling task.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(slots=True)
class CallTimer:
    queue_ns: int = 0
    executor_ns: int = 0


current_call_timer: ContextVar[CallTimer | None] = ContextVar("current_call_timer", default=None)
