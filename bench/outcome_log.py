"""A pytest plugin for bench/gpu_check.py: each test's outcome as one JSON line, written as it ends.

`pytest -p bench.outcome_log` with OUTCOME_LOG=<path>. Unlike a JUnit file, written once at the
end of the session, the lines are there even when the check stops the stage at its time limit.
"""

from __future__ import annotations

import json
import os
import time

PATH_VARIABLE = "OUTCOME_LOG"


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
    text = report.longreprtext or ""
    return (crash + "\n" if crash else "") + text[-2000:]  # the error first, then the traceback's end


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(PATH_VARIABLE)
    if not path:
        return
    if report.when == "call":
        outcome = "passed" if report.passed else ("skipped" if report.skipped else "failed")
    elif report.failed:
        outcome = "error"  # in setup or teardown
    elif report.skipped and report.when == "setup":
        outcome = "skipped"
    else:
        return
    row = {"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3),
           "message": _message(report) if outcome != "passed" else "", "ended": time.time(),
           **{str(k): v for k, v in report.user_properties}}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
