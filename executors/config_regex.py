"""Regular expressions that come from a caller (a LoRA adapter's target_modules), matched
within a time budget.

Python's `re` backtracks without limit and holds the GIL for a whole match: one
expression like `(a|aa)+b` from an uploaded adapter config would freeze the event loop, the
step worker and the health checks for minutes. The `regex` package reads the same syntax
(its VERSION0 is re's), avoids much of that backtracking, and takes a timeout; with
`concurrent=True` it lets go of the GIL while it matches.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import regex

MATCH_BUDGET_S = 0.5  # for all the candidates together: a sane pattern takes microseconds each
MAX_PATTERN_CHARS = 4096


class PatternError(ValueError):
    """The pattern does not compile, is too long, or did not finish within the budget."""


def fullmatching(pattern: str, candidates: Iterable[str], budget_s: float = MATCH_BUDGET_S) -> set[str]:
    """The candidates that `pattern` matches whole (as re.fullmatch would)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"is {len(pattern)} characters long; at most {MAX_PATTERN_CHARS} are accepted")
    try:
        compiled = regex.compile(pattern, flags=regex.VERSION0)
    except (regex.error, ValueError, OverflowError) as e:
        raise PatternError(f"is not a valid regular expression: {e}") from None
    deadline = time.monotonic() + budget_s
    matched = set()
    for candidate in candidates:
        try:
            if compiled.fullmatch(candidate, concurrent=True, timeout=max(deadline - time.monotonic(), 1e-3)):
                matched.add(candidate)
        except TimeoutError:
            raise PatternError(f"took more than {budget_s:g} s to match the model's module paths (it backtracks "
                               "without bound); use a simpler expression or a list of module names") from None
    return matched
