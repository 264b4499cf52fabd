"""A decode step left in flight on the device while the worker takes the next one.

Run 33 (bench/RESULTS.md) measured a batch-1 decode step on an H200 at 2.45 ms of wall time
for a 1.46 ms graph: the host's ~1 ms (the step's bookkeeping, the copy of its tokens to the
host, the answer, the next request's checks and staging) ran while the device sat idle. A
scheduler that feeds each step the token the last one sampled (`feed_sampled_token`) and keeps
two steps in flight gives the worker the next step before the last one's tokens are back. So
a step whose rows all went through the decode graphs and all want a plain ARGMAX token (their
ids and log-probabilities: argmax pairs the graph computes), and some of which were fed (the
mark of such a scheduler; one that sends its tokens waits for each step, and is answered at
once), is not finished when its forward is queued: its pairs start their copy to the host,
its caller's answer waits in an `InFlightStep`, and the worker moves on. The next step, if it continues those caches, is
resolved, staged and launched at once, its fed tokens read on the device from the step in
flight (`DecodeGraphs`: the graph gathers them before its embedding); only then is the step in
flight settled: its pairs read, its caches committed and recorded, its caller answered.

Everything else settles the step in flight first (SerialWorker runs no other job beside it),
as does a step that touches its caches other than by continuing them (a retry replays from the
record, which settling makes), so every call sees what it would have seen without the overlap.
Its bookkeeping (blocks, lengths, handles) is done before it is launched; settling only names
the filled blocks, records the step for a retry and answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from executors.step_items import ItemSpec, StepItem
from executors.types import LogitsKind, LogitsPolicy
from executors.worker import SerialWorker


def plain_argmax(policy: LogitsPolicy) -> bool:
    """A policy that wants nothing but the argmax pairs a decode graph computes."""
    return policy.kind is LogitsKind.ARGMAX and not policy.adjusts and not policy.top_logprobs


class HostPairs:
    """A step's argmax pairs ([2, n]: ids and log-probabilities) on their way to the host."""

    def __init__(self, pairs: torch.Tensor) -> None:
        if pairs.is_cuda:
            # Pinned, so the copy is queued behind the graph and the host does not wait for it;
            # the next replay, which overwrites the graph's output, is queued behind the copy.
            self._host = torch.empty(pairs.shape, dtype=pairs.dtype, pin_memory=True)
            self._host.copy_(pairs, non_blocking=True)
            self._done: torch.cuda.Event | None = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = pairs.clone(), None

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def read(self) -> tuple[list[int], list[float]]:
        if self._done is not None:
            self._done.synchronize()
        ids, logprobs = self._host.tolist()
        return [int(t) for t in ids], logprobs


@dataclass(eq=False)
class InFlightStep:
    """A launched step whose caller waits in `future`; `conclude(ids, logprobs)` finishes it on
    the worker (its bookkeeping, then its results)."""

    pairs: HostPairs
    rows: dict[str, int]  # cache id -> its row in the step (the row a fed token comes from)
    ends: dict[str, int]  # cache id -> its length once the step ran
    conclude: Callable[[list[int], list[float]], list]
    future: Future = field(default_factory=Future)
    sampled: list[int] | None = None  # the rows' ids, once settled

    def __post_init__(self) -> None:
        # Running from the start: a caller that goes away cannot cancel it, and its clean-up
        # (on_abandon) then runs on what settling returns.
        self.future.set_running_or_notify_cancel()

    def ready(self) -> bool:
        return self.pairs.ready()

    def settle(self) -> None:
        try:
            ids, logprobs = self.pairs.read()
            results = self.conclude(ids, logprobs)
        except BaseException as e:  # noqa: BLE001 -- the device failed: the caller hears it, the worker goes on
            self.future.set_exception(e)
        else:
            self.sampled = ids
            self.future.set_result(results)

    def continued_by(self, specs: Sequence[ItemSpec]) -> bool:
        """Whether a step of these specs may run before this one is settled: it touches this
        step's caches only by decoding the next token of each (fed or given)."""
        return all(s.cache_id not in self.ends or (s.is_decode and s.expected_length == self.ends[s.cache_id])
                   for s in specs)

    def fed_token(self, row: int) -> int:
        if self.sampled is None:
            raise RuntimeError("the step whose sampled token this one feeds on failed on the device")
        return self.sampled[row]


async def settled_results(done: list | InFlightStep, worker: SerialWorker, undo: Callable[[list], None]) -> list:
    """A step's results: at once, or once it settles when it was left in flight. A caller that
    goes away meanwhile leaves `undo` (the caches the step created go) to run once it settles."""
    if not isinstance(done, InFlightStep):
        return done
    try:
        return await asyncio.wrap_future(done.future)
    except asyncio.CancelledError:
        worker.undo_when_done(done.future, undo)
        raise


def undo_when_settled(worker: SerialWorker, undo: Callable[[list], None], done: list | InFlightStep) -> None:
    """on_abandon for a step whose caller went away while it ran: `undo` its results, once it
    settles if it was left in flight."""
    if isinstance(done, InFlightStep):
        worker.undo_when_done(done.future, undo)
    else:
        undo(done)


def fill_fed_tokens(work: Sequence[tuple[ItemSpec, StepItem]], flight: InFlightStep) -> None:
    """Once `flight` is settled: the host learns the tokens its rows fed to this step's."""
    for s, it in work:
        if it.fed_row is not None:
            s.tokens = it.tokens = [flight.fed_token(it.fed_row)]
            s.fed_row = it.fed_row = None
