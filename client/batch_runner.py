"""A batch of prompts through a scheduler, with progress (the CLI: client/schedule_cli.py).

`run_batch` submits every prompt at once to a Scheduler (client/scheduler.py) or anything
with its `submit` (DisaggregatedScheduler) and gathers the completions in prompt order;
`_Progress` draws its one-line progress bar. Apart from the Scheduler: it only uses the
public submit() and the streams it returns.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from .errors import ExecutorError
from .scheduler_types import Completion
from .sequence import RequestStream
from .types import LogitsPolicy, Penalties

__all__ = ["run_batch"]


class _Progress:
    """A one-line progress bar on stderr (rewritten in place on a terminal, else a line per request)."""

    def __init__(self, total: int, stream: Any = None, width: int = 24) -> None:
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.done = 0
        self.tokens = 0
        self._last = 0.0

    def update(self, *, token: bool = False, finished: bool = False) -> None:
        self.tokens += token
        self.done += finished
        now = time.monotonic()
        if not finished and (not self.tty or now - self._last < 0.1):
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        filled = self.width * self.done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} requests  "
                f"{self.tokens} tokens  {self.tokens / elapsed:.1f} tok/s  {elapsed:.1f}s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def run_batch(scheduler: Any, prompts: list[list[int]], *, max_tokens: int,
                    policy: LogitsPolicy | Sequence[LogitsPolicy | None] | None = None,
                    progress: _Progress | None = None, ignore_eos: bool = False,
                    penalties: Penalties | None = None, min_tokens: int = 0) -> list[Completion]:
    """Submit every prompt at once to `scheduler` (a Scheduler, or anything with its `submit`,
    as DisaggregatedScheduler); wait for all; return the completions in prompt order.

    `policy`: one for all prompts, or one per prompt (None: ARGMAX). `penalties` and
    `min_tokens`: every prompt's (Scheduler.submit's)."""
    policies = list(policy) if isinstance(policy, Sequence) else [policy] * len(prompts)
    async def consume(i: int, stream: RequestStream) -> Completion:
        try:
            async for _ in stream:
                if progress:
                    progress.update(token=True)
        except ExecutorError:
            pass  # reported in the completion
        if progress:
            progress.update(finished=True)
        return await stream.result()

    streams = [scheduler.submit(p, max_tokens=max_tokens, policy=pol, ignore_eos=ignore_eos,
                                request_id=f"req-{i}", penalties=penalties, min_tokens=min_tokens)
               for i, (p, pol) in enumerate(zip(prompts, policies))]
    return list(await asyncio.gather(*(consume(i, s) for i, s in enumerate(streams))))
