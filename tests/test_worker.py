"""SerialWorker (executors/worker.py): jobs one at a time, and a step left in flight settled
before any job that does not overlap it, once the device is done when the worker is idle, and
before the worker stops."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from executors.worker import SerialWorker


class Flight:
    """An InFlight whose device finishes when `done` is set; records when it was settled."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.done = log, threading.Event()

    def ready(self) -> bool:
        return self.done.is_set()

    def settle(self) -> None:
        self.log.append("settled")


def test_jobs_that_do_not_overlap_run_after_the_step_in_flight_settles():
    worker, log = SerialWorker("test"), []

    async def scenario():
        flight = Flight(log)
        await worker.run(lambda: setattr(worker, "in_flight", flight))
        await worker.run(log.append, "overlapping", overlaps=True)  # the next step: runs beside it
        assert log == ["overlapping"] and worker.in_flight is flight
        await worker.run(log.append, "release")  # anything else: after it settled
        assert log == ["overlapping", "settled", "release"] and worker.in_flight is None

    asyncio.run(scenario())
    worker.close()


def test_an_idle_worker_settles_the_step_once_the_device_is_done():
    worker, log = SerialWorker("test"), []
    flight = Flight(log)
    worker.schedule(lambda: setattr(worker, "in_flight", flight)).result()
    time.sleep(0.05)
    assert log == []  # the device is still running it: nothing to settle
    flight.done.set()
    deadline = time.monotonic() + 5
    while not log and time.monotonic() < deadline:
        time.sleep(0.001)
    assert log == ["settled"] and worker.in_flight is None
    worker.close()


def test_close_settles_the_step_in_flight():
    worker, log = SerialWorker("test"), []
    worker.schedule(lambda: setattr(worker, "in_flight", Flight(log))).result()  # its device never finishes
    worker.close()
    assert log == ["settled"] and worker.in_flight is None


def test_close_finishes_the_job_under_way_and_drops_what_is_queued():
    worker, log = SerialWorker("test"), []
    gate, started = threading.Event(), threading.Event()
    running = worker.schedule(lambda: started.set() or gate.wait(10))
    queued = worker.schedule(log.append, "never")
    assert started.wait(5)
    threading.Timer(0.1, gate.set).start()
    worker.close()
    assert running.result() is True and queued.cancelled() and log == []


def test_a_failing_job_reaches_its_caller_and_the_worker_goes_on():
    worker = SerialWorker("test")

    async def scenario():
        with pytest.raises(ZeroDivisionError):
            await worker.run(lambda: 1 / 0)
        assert await worker.run(lambda: 42) == 42

    asyncio.run(scenario())
    worker.close()
