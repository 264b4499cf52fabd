"""The README's code blocks as data, and how tests/test_readme.py runs them.

Every fenced block in README.md is preceded by a marker line:
    <!-- example: NAME -->              a test runs it (tests/test_readme.py, one per NAME)
    <!-- not an example: REASON -->     a diagram, or something the test machines cannot run

Blocks run as written, with these substitutions only: the address `localhost:50051` (and
other example addresses) become the test servers' addresses, `python` is the interpreter
running the tests, and `3f9c...` (the README's placeholder token) a real token. Console
blocks (`$ command` lines, each followed by its output) are compared with their output:
- timings (a number of seconds, tokens/s or requests/s) may differ; every other text
  must be equal, generated text included;
- an output that is a JSON object is compared as JSON, its `timing` and `idle_seconds`
  values ignored and its floating-point numbers within 1e-3;
- a line ending in `(stderr)` is the last line the command wrote to stderr;
- an output that starts with `ERROR:` is a failed call (grpcurl's non-zero exit).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- (example: (?P<name>[\w-]+)|not an example: (?P<why>.+)) -->$")
TIMING = re.compile(r"\b\d+(\.\d+)?(?=( ?(s|tok/s|tokens/s|requests/s)\b))")
PLACEHOLDER_TOKEN = "3f9c..."
# JSON keys whose values are times, which may differ: how long a call took, and how long
# a cache has been idle (ListCaches).
VARYING = frozenset({"timing", "idle_seconds"})


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    name: str | None  # the example's name; None for a block that is not an example
    why_not: str | None


def blocks(path: Path = REPO / "README.md") -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            marker = MARKER.match(lines[start - 1]) if start else None
            out.append(Block(start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                             marker and marker["name"], marker and marker["why"]))
            i = j
        i += 1
    return out


def example(name: str) -> Block:
    found = [b for b in blocks() if b.name == name]
    assert len(found) == 1, f"README example {name!r}: {len(found)} blocks"
    return found[0]


def substitute(text: str, addresses: dict[str, str], token: str | None = None) -> str:
    for written, actual in addresses.items():
        text = text.replace(written, actual)
    if token is not None:
        text = text.replace(PLACEHOLDER_TOKEN, token)
    return text


def shell(command: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A README command through bash, `python` being the interpreter running the tests."""
    command = re.sub(r"(?<![\w./-])python(?= )", sys.executable, command)
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def console_steps(code: str) -> list[tuple[str, list[str]]]:
    """(`$` command, expected output lines) of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"output before the first command: {line!r}"
            steps[-1][1].append(line)
    return steps


def _timings_free(line: str) -> str:
    return TIMING.sub("<n>", line.rstrip())


def _same_json(actual, expected, where: str = "") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (where, actual, expected)
        for key in expected:
            if key not in VARYING:
                _same_json(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (where, actual, expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            _same_json(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert isinstance(actual, (int, float)) and math.isclose(actual, expected, abs_tol=1e-3), (where, actual)
    else:
        assert actual == expected, (where, actual, expected)


def check_output(command: str, done: subprocess.CompletedProcess[str], expected: list[str]) -> None:
    text = "\n".join(expected)
    if text.startswith("ERROR:"):
        assert done.returncode != 0, f"{command}: expected a failure, got {done.stdout}"
    else:
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    if not expected:
        return
    if text.lstrip().startswith("{"):
        _same_json(json.loads(done.stdout), json.loads(text))
        return
    stderr_lines = [x for x in done.stderr.replace("\r", "\n").splitlines() if x.strip()]
    want = [x for x in expected if not x.endswith("(stderr)")]
    for x in expected:
        if x.endswith("(stderr)"):
            assert stderr_lines, f"{command}: nothing on stderr"
            assert _timings_free(stderr_lines[-1]) == _timings_free(x.removesuffix("(stderr)")), stderr_lines[-1]
    got = (done.stdout if not text.startswith("ERROR:") else done.stderr).rstrip("\n").splitlines()
    assert [_timings_free(x) for x in got] == [_timings_free(x) for x in want], \
        f"{command}: output differs from the README's\n--- got\n{chr(10).join(got)}\n--- README\n{chr(10).join(want)}"


def run_console(block: Block, addresses: dict[str, str], cwd: Path) -> None:
    for command, expected in console_steps(block.code):
        if command == ". .venv/bin/activate":  # the tests already run in that environment
            continue
        command = substitute(command, addresses)
        if re.search(r"(^| )python -m client (?!.*--target)", command):  # the client's default target
            command = command.replace("python -m client ", f"python -m client --target {addresses['localhost:50051']} ", 1)
        check_output(command, shell(command, cwd), expected)


def commands(block: Block) -> list[str]:
    """The command lines of a shell block: comment lines and trailing comments dropped
    (grpcurl's `# fails: Code` stays; the grpcurl test reads it)."""
    out = []
    for line in block.code.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "  # " in line and "  # fails: " not in line:
            line = line.split("  # ", 1)[0].rstrip()
        out.append(line)
    return out
