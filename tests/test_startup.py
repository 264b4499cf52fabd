"""Start-up says what it is doing: no silence over two seconds without a line saying why.

`python -m service` on the embedded model (what `make serve` starts), its output read line
by line with arrival times: a first line at once (before torch is imported, which takes
seconds), model loading to 100 %, the KV pool's size in blocks, tokens and bytes before it
is allocated, then listening and serving.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from client import ExecutorClient
from service.config import ServeConfig, parse_args
from tests.conftest import PAGED_TEST_CONFIG, start_server
from tests.server_process import serve_paged

# Asserts wall-clock bounds or orders events by sleeping: `make test` runs it alone (tests/conftest.py).
pytestmark = pytest.mark.alone

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


# -- start-up failures: one line naming the problem, status 1 (2 for a bad flag), no traceback --

NOISE = ("Traceback", "Event loop is closed", "was never awaited", "Exception ignored")


def run_service(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service", *args], check=False, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def assert_fails_with(proc: subprocess.CompletedProcess, message: str, status: int = 1) -> None:
    """`message`: a regular expression the last line of stderr must match in full."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, out
    assert not [n for n in NOISE if n in out], out
    assert re.fullmatch(message, proc.stderr.strip().splitlines()[-1]), out


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port with a listener on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_start_up_failures_are_one_line_without_a_traceback(busy_port):
    cases = {
        "busy_port": (["--port", str(busy_port)], rf"modelexec: cannot listen on 127\.0\.0\.1:{busy_port}: the port is in use"),
        # TEST-NET-1 (RFC 5737): an address no host here has.
        "foreign_host": (["--host", "192.0.2.1", "--port", "0"], r"modelexec: cannot listen on 192\.0\.2\.1:0: .+"),
        "no_directory": (["--unix-socket", "/nonexistent/dir/x.sock"],
                         r"modelexec: cannot listen on unix:/nonexistent/dir/x\.sock: no directory /nonexistent/dir"),
        "busy_metrics_port": (["--port", "0", "--metrics-port", str(busy_port)],
                              rf"modelexec: cannot serve metrics on 127\.0\.0\.1:{busy_port}: the port is in use"),
        "warmup": (["--port", "0", "--num-blocks", "1", "--block-size", "1"],
                   (r"modelexec: warm-up failed: its prompt needs \d+ KV blocks and the pool has 1 "
                    r"\(--num-blocks, --block-size\)")),
    }
    # All at once: each spends its seconds importing torch, and they do not share anything.
    procs = {case: subprocess.Popen([sys.executable, "-m", "service", "--executor", "paged", *args], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case, (args, _) in cases.items()}
    try:
        for case, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert_fails_with(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), cases[case][1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_corrupt_lora_adapter_fails_the_start_in_one_line(smollm2_dir, tmp_path):
    bad = tmp_path / "lora" / "bad"
    bad.mkdir(parents=True)
    (bad / "adapter_config.json").write_text("{not json")
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    proc = run_service("--model", str(smollm2_dir), "--unix-socket", str(tmp_path / "s.sock"),
                       "--lora-dir", str(tmp_path / "lora"))
    assert_fails_with(proc, r"modelexec: LoRA adapter 'bad'.*")


def test_the_server_stops_its_grpc_server_when_its_start_fails(busy_port):
    """In process: a start that fails after the bind (here the metrics port, taken after the
    check) leaves nothing listening, and no gRPC server for a closed loop to stop later."""
    from service.listen import StartupError
    from service.server import ExecutorServer

    server = ExecutorServer(ServeConfig(port=0, executor="paged", metrics_port=busy_port))
    with pytest.raises(StartupError, match=f"cannot serve metrics on 127.0.0.1:{busy_port}: the port is in use"):
        asyncio.run(server.start())
    host, port = server.address.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), 2).close()
    taken = ExecutorServer(ServeConfig(port=busy_port, executor="paged"))
    with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{busy_port}: the port is in use"):
        asyncio.run(taken.start())


# -- unix sockets: a live server's is refused, a stale one replaced --

def test_a_second_server_on_a_live_unix_socket_is_refused():
    with serve_paged() as first:
        path = first.address.removeprefix("unix://")
        proc = subprocess.Popen([sys.executable, "-m", "service", "--executor", "paged", "--unix-socket", path],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=30)  # without the check it takes the socket over and serves
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert_fails_with(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                          rf"modelexec: another server listens on {re.escape(path)}")
        with ExecutorClient(first.target, timeout=10) as c:  # the first still has it
            assert c.health().status == health_pb2.HealthCheckResponse.SERVING


def test_a_stale_unix_socket_is_replaced(tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: what a killed server leaves
        dead.bind(str(path))
    running = start_server(replace(PAGED_TEST_CONFIG, unix_socket=str(path)))
    try:
        with ExecutorClient(f"unix://{path}", timeout=10) as c:
            assert c.health().status == health_pb2.HealthCheckResponse.SERVING
    finally:
        running.stop()


# -- flags --

@pytest.mark.parametrize("args, message", [
    (["--grace-seconds", "nan"], r"grace_seconds must be in \[0, 3600\], got nan"),
    (["--grace-seconds", "inf"], r"grace_seconds must be in \[0, 3600\], got inf"),
    (["--grace-seconds", "3601"], r"grace_seconds must be in \[0, 3600\], got 3601"),
    (["--device", "cudax"], "device must be cpu, cuda or cuda:N, got 'cudax'"),
    (["--device", "cuda:"], "device must be cpu, cuda or cuda:N, got 'cuda:'"),
    (["--executor", "paged", "--device", "cpu"], "--device is a flag of --executor llm; the paged executor does not"),
    (["--executor", "paged", "--dtype", "float32"], "--dtype is a flag of --executor llm"),
    (["--executor", "paged", "--model", "x"], "--model is a flag of --executor llm"),
    (["--executor", "paged", "--lora-dir=/tmp"], "--lora-dir is a flag of --executor llm"),
    (["--executor", "paged", "--no-cuda-graphs"], "--no-cuda-graphs is a flag of --executor llm"),
    (["--executor", "paged", "--no-fused-kernels"], "--no-fused-kernels is a flag of --executor llm"),
    (["--executor", "paged", "--triton-gemv"], "--triton-gemv is a flag of --executor llm"),
    (["--executor", "paged", "--no-step-overlap"], "--no-step-overlap is a flag of --executor llm"),
    (["--executor", "paged", "--max-loras", "8"], "--max-loras is a flag of --executor llm"),
])
def test_bad_flags_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(args)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_flags_of_the_executor_chosen_are_taken():
    assert parse_args(["--device", "cuda:1", "--no-cuda-graphs", "--max-loras", "3", "--grace-seconds", "3600"]) \
        == ServeConfig(device="cuda:1", cuda_graphs=False, max_loras=3, grace_seconds=3600)
    assert parse_args(["--no-fused-kernels"]) == ServeConfig(triton_fused_ops=False)
    from service.server import llm_config

    assert llm_config(ServeConfig(triton_fused_ops=False)).triton_fused_ops is False
    assert parse_args(["--triton-gemv"]) == ServeConfig(triton_gemv=True)
    assert llm_config(ServeConfig(triton_gemv=True)).triton_gemv is True
    assert parse_args(["--no-step-overlap"]) == ServeConfig(step_overlap=False)
    assert llm_config(ServeConfig(step_overlap=False)).step_overlap is False
    assert llm_config(ServeConfig()).step_overlap is True
    assert parse_args(["--executor", "paged", "--num-blocks", "8", "--block-size", "4"]) \
        == ServeConfig(executor="paged", num_blocks=8, block_size=4)


# -- Ctrl-C before serving: status 130, no traceback --

def interrupt_once(args: list[str], line: str) -> tuple[int, str]:
    """Start `python -m service ARGS`, SIGINT it as soon as it prints `line`; its status and output."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "service", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for out in proc.stdout:
            seen.append(out)
            if line in out:
                proc.send_signal(signal.SIGINT)
                break
        seen.append(proc.communicate(timeout=30)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, "".join(seen)


def test_ctrl_c_during_the_imports_exits_130_quietly(tmp_path):
    status, out = interrupt_once(["--executor", "paged", "--unix-socket", str(tmp_path / "s.sock")],
                                 "modelexec: starting")
    assert status == 130 and not [n for n in NOISE if n in out], out
    assert "modelexec: serving" not in out


def test_ctrl_c_during_the_model_load_exits_130_quietly(smollm2_dir, tmp_path):
    status, out = interrupt_once(["--model", str(smollm2_dir), "--unix-socket", str(tmp_path / "s.sock")],
                                 "loading smollm2-135m-instruct (")
    assert status == 130 and not [n for n in NOISE if n in out], out
    assert "modelexec: serving" not in out
