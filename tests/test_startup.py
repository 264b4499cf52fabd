"""Start-up says what it is doing: no silence over two seconds without a line saying why.

`python -m service` on the embedded model (what `make serve` starts), its output read line
by line with arrival times: a first line at once (before torch is imported, which takes
seconds), model loading to 100 %, the KV pool's size in blocks, tokens and bytes before it
is allocated, then listening and serving.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SILENCE_S = 2.0


def test_start_up_is_never_silent_for_long(smollm2_dir, tmp_path):
    sock = tmp_path / "s.sock"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-u", "-m", "service", "--unix-socket", str(sock)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip()))
            if "modelexec: serving" in line:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    text = "\n".join(x for _, x in lines)
    assert lines and "modelexec: serving" in lines[-1][1], text
    first_at, first = lines[0]
    assert first.startswith("modelexec: starting: importing torch and grpc") and first_at < SILENCE_S, lines[0]
    assert re.search(r"loading smollm2-135m-instruct \(LlamaForCausalLM, 538 MB in 1 file\) as float32 onto cpu", text)
    assert re.search(r"loading smollm2-135m-instruct: 100% of 538 MB", text), text
    assert re.search(r"allocating the KV pool: 1024 blocks of 16 tokens \(16384 tokens\), 720\.0 MiB of float32 on cpu",
                     text), text
    # Every gap longer than SILENCE_S follows the first line, which says the imports take a while.
    long_gaps = [(lines[i - 1][1], b - a) for i, ((a, _), (b, _)) in enumerate(zip(lines, lines[1:]), 1)
                 if b - a > SILENCE_S]
    assert all(prev == first for prev, _ in long_gaps), long_gaps
