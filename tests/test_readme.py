"""Every example the README shows runs here, as written, and shows what the README says.

tests/readme.py reads the blocks and says what "as written" allows (addresses, `python`,
the placeholder token). One test per example; the first test holds the README to that:
every block is an example with its test here, or says why it is not one.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput
from generated.modelexec.v1 import executor_pb2 as pb
from service.config import ServeConfig
from tests import readme
from tests.conftest import start_server
from tests.pki import make_pki

REPO = readme.REPO
ADDRESS = "localhost:50051"


def llm_config(model: Path, **overrides) -> ServeConfig:
    """What `make serve` starts: the embedded model with the default pool."""
    return ServeConfig(**{"port": 0, "executor": "llm", "model": str(model), "block_size": 16, "num_blocks": 1024,
                          **overrides})


@pytest.fixture(scope="module")
def embedded(smollm2_dir):
    running = start_server(llm_config(smollm2_dir))
    yield running
    running.stop()


@pytest.fixture
def fresh_embedded(smollm2_dir):
    running = start_server(llm_config(smollm2_dir))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def other_embedded(smollm2_dir):
    """A second server of the embedded model (localhost:50052 in the README): where caches move to.
    A small pool (1024 tokens): the moves need a few blocks, and the weights take memory enough."""
    running = start_server(llm_config(smollm2_dir, num_blocks=64))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def two_more(smollm2_dir):
    """Two more servers of the embedded model (gpu1, gpu2 in the README's multi-executor
    examples), started once for the router and the disaggregated examples."""
    running = [start_server(llm_config(smollm2_dir, num_blocks=256)) for _ in range(2)]
    yield running
    for r in running:
        r.stop()


def run_python(code: str, cwd: Path, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """A README Python block in a process of its own; top-level `await` and `async with` run
    under asyncio, as in an asyncio REPL (`python -m asyncio`)."""
    runner = ("import ast, asyncio, sys\n"
              "source = sys.stdin.read()\n"
              "code = compile(source, '<README>', 'exec', flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)\n"
              "result = eval(code, {'__name__': '__main__'})\n"
              "if asyncio.iscoroutine(result):\n"
              "    asyncio.run(result)\n")
    return subprocess.run([sys.executable, "-c", runner], input=prelude + code, cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


# -- the README as a whole -----------------------------------------------------------------
def test_every_block_is_an_example_with_a_test_or_says_why_not():
    found = readme.blocks()
    unmarked = [b.line for b in found if b.name is None and b.why_not is None]
    assert unmarked == [], f"README blocks at lines {unmarked} have no example or not-an-example marker"
    names = [b.name for b in found if b.name]
    assert len(names) == len(set(names)), names
    tests = {name.removeprefix("test_example_").replace("_", "-") for name in globals()
             if name.startswith("test_example_")}
    assert set(names) == tests, f"examples without a test: {set(names) - tests}; tests without: {tests - set(names)}"


# -- the two commands ------------------------------------------------------------------------
def test_example_make(tmp_path):
    serve, test = readme.commands(readme.example("make"))
    assert (serve, test) == ("make serve", "make test")
    # `make test` is what CI runs: .ci/run is that command and nothing else.
    ci = [x for x in (REPO / ".ci" / "run").read_text().splitlines() if x.strip() and not x.startswith("#")]
    assert ci[-1] == "make test"
    # `make serve` installs (already done: a no-op here), converts the model (done too) and
    # serves; here on a unix socket, with the interpreter running the tests.
    sock = tmp_path / "serve.sock"
    proc = subprocess.Popen(["make", "-s", "serve", f"PY={sys.executable}", f"ARGS=--unix-socket {sock}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if "modelexec: serving" in line or time.monotonic() > deadline:
                break
        assert any(f"serving the llm executor on unix:{sock}" in x for x in lines), "".join(lines[-30:])
        with ExecutorClient(f"unix://{sock}") as c:
            c.wait_ready(60)
            assert c.info().model_id == "smollm2-135m-instruct"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def test_example_generate(embedded, tmp_path):
    readme.run_console(readme.example("generate"), {ADDRESS: embedded.address}, REPO)


# -- the clients -----------------------------------------------------------------------------
def test_example_client_install(installed_client, paged_server, tmp_path):
    python, checkout = installed_client
    for line in readme.commands(readme.example("client-install")):
        line = line.replace("/path/to/a/checkout", str(checkout)).replace(ADDRESS, paged_server.address)
        env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)  # outside the checkout: only what is installed
        ok(done)
        if line.startswith("modelexec-client"):
            assert json.loads(done.stdout)["state"]


def test_example_python_client(embedded, tmp_path):
    out = ok(run_python(readme.substitute(readme.example("python-client").code, {ADDRESS: embedded.address}),
                        tmp_path))
    shape, length, executor_ns = out.split(")")[0] + ")", *out.split(")")[1].split()
    assert shape.startswith("(") and int(length) == 4 and int(executor_ns) > 0


def test_example_adjustments(embedded, tmp_path):
    out = ok(run_python(readme.substitute(readme.example("adjustments").code, {ADDRESS: embedded.address}),
                        tmp_path))
    greedy, other, counts = out.split(maxsplit=2)
    assert 100 <= int(other) < 200 and int(other) != int(greedy), out
    assert counts.strip() == "(1, 0, 0, 0)", out  # the generated token once, the prompt's three at 0
    with ExecutorClient(embedded.address) as c:
        assert c.list_caches() == [], "the example releases what it made"


def test_example_scheduler(embedded, tmp_path):
    code = readme.substitute(readme.example("scheduler").code, {ADDRESS: embedded.address})
    ok(run_python(code, tmp_path, prelude="prompt_ids = [1, 2, 3, 4]\n"))


def test_example_schedule(embedded):
    readme.run_console(readme.example("schedule"), {ADDRESS: embedded.address}, REPO)


def test_example_speculative(embedded, smollm2_dir, tmp_path):
    draft = start_server(llm_config(smollm2_dir, num_blocks=256))
    try:
        code = readme.substitute(readme.example("speculative").code,
                                 {ADDRESS: embedded.address, "localhost:50052": draft.address})
        out = ok(run_python(code, tmp_path, prelude="prompt_ids = [1, 504, 1013, 314, 4235, 282]\n"))
        tokens, acceptance, per_round = out.rsplit("]", 1)[0] + "]", *out.rsplit("]", 1)[1].split()
        assert 0 < len(ast.literal_eval(tokens)) <= 64
        assert float(acceptance) == 1.0 and float(per_round) > 1  # the target's own weights draft
    finally:
        draft.stop()


def three_addresses(embedded, two_more) -> dict[str, str]:
    """The README's three example addresses, mapped to the three running servers."""
    return {"gpu0:50051": embedded.address, "gpu1:50051": two_more[0].address, "gpu2:50051": two_more[1].address}


def test_example_router(embedded, two_more):
    (line,) = readme.commands(readme.example("router"))
    addresses = three_addresses(embedded, two_more)
    out = ok(readme.shell(readme.substitute(line, addresses), REPO))
    assert "8 requests (0 failed) on 3 executor(s)" in out


def test_example_tensor_parallel(embedded):
    """The embedded model over three gloo ranks, started as written (on a free port): one
    endpoint, three ranks, the single process's logits; SIGTERM leaves no rank behind."""
    import numpy as np

    from bench.service_process import launch, stop, wait_ready, wait_session_gone

    (line,) = readme.commands(readme.example("tensor-parallel"))
    words = shlex.split(line)
    assert words[:3] == ["python", "-m", "service"] and words[-2] == "--port"
    server = launch("tcp", words[3:-2])
    try:
        wait_ready(server, 240)
        tokens = [1, 504, 3458, 282, 4649, 314, 1345, 28]
        with ExecutorClient(server.address, timeout=120) as c, ExecutorClient(embedded.address) as one:
            layout = c.info().parallel
            assert layout.tensor_parallel_size == 3 and layout.launcher == "spawn" and len(layout.ranks) == 3
            mine, theirs = c.prefill(PrefillInput(tokens)), one.prefill(PrefillInput(tokens))
            one.release_cache(theirs.kv_cache)
            got, want = mine.logits.logits, theirs.logits.logits
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
            assert int(np.argmax(got)) == int(np.argmax(want))
        server.proc.terminate()
        server.proc.wait(60)
        assert not wait_session_gone(server.proc.pid, 30), "a rank outlived SIGTERM"
    finally:
        stop(server)


def test_example_disaggregated(embedded, two_more):
    (line,) = readme.commands(readme.example("disaggregated"))
    addresses = three_addresses(embedded, two_more)
    out = ok(readme.shell(readme.substitute(line, addresses), REPO))
    assert "8 requests (0 failed) on 1 prefill + 2 decode executors" in out
    assert "\nmoves: " in out and "latency: first token mean" in out  # a request that stops at once never moves
    for running in (embedded, *two_more):
        with ExecutorClient(running.address) as c:
            assert c.status().kv_pool.used_blocks == 0 and c.list_caches() == []


def test_example_typescript(paged_server, tmp_path):
    """The package's commands as written, in a copy laid out as the repository (its own npm ci)."""
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    ts = REPO / "client" / "typescript"
    shutil.copytree(ts, tmp_path / "client" / "typescript",
                    ignore=shutil.ignore_patterns("node_modules", "dist", "gen"))
    script = " && ".join(readme.commands(readme.example("typescript")))
    done = readme.shell(readme.substitute(script, {ADDRESS: paged_server.address}), tmp_path, timeout=600)
    steps = [json.loads(x)["step"] for x in ok(done).splitlines() if x.startswith("{")]
    assert steps == ["info", "prefill", "decode", "release", "constrained", "status"], done.stdout


# -- grpcurl ---------------------------------------------------------------------------------
def test_example_grpcurl(smollm2_dir):
    grpcurl = shutil.which("grpcurl")
    assert grpcurl, "grpcurl is a test dependency: pip install -r requirements-test.txt"
    lines = readme.commands(readme.example("grpcurl"))
    for rpc in ("GetInfo", "GetCapabilities", "GetStatus", "Prefill", "Decode", "BatchPrefill", "BatchDecode",
                "UnifiedDecode", "Forward", "ForwardVerify", "TruncateKv", "ReleaseCache", "GetCacheMetrics",
                "GetLoraMetrics", "Warmup", "Shutdown", "StepSession", "ListLoraAdapters", "LoadLoraAdapter",
                "UnloadLoraAdapter"):
        assert any(f"ModelExecutorService/{rpc}" in x for x in lines), rpc
    running = start_server(llm_config(smollm2_dir))
    try:
        for line in lines:
            command, _, expectation = line.partition("  # fails: ")
            done = subprocess.run(shlex.split(command.replace(ADDRESS, running.address)), capture_output=True,
                                  text=True, timeout=30)
            if expectation:
                code = expectation.split()[0]
                assert done.returncode != 0 and f"Code: {code}" in done.stderr, (line, done.stdout, done.stderr)
            else:
                assert done.returncode == 0, (line, done.stdout, done.stderr)
    finally:
        running.stop()


def test_example_prefill_answer(fresh_embedded):
    readme.run_console(readme.example("prefill-answer"), {ADDRESS: fresh_embedded.address}, REPO)


def test_example_stale_handle(fresh_embedded):
    readme.run_console(readme.example("stale-handle"), {ADDRESS: fresh_embedded.address}, REPO)


# -- moving caches ---------------------------------------------------------------------------
MOVED_PROMPT = [1, 504, 1013, 314, 4235, 282]


def json_messages(text: str) -> list[dict]:
    """The JSON objects grpcurl printed one after another (one per response message)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while (at := text.find("{", at)) >= 0:
        message, at = decoder.raw_decode(text, at)
        out.append(message)
    return out


def test_example_move_grpcurl(embedded, other_embedded, tmp_path):
    """The block as one bash script (its Python lines span several), stopping at the first
    failure; then the cache is on the target only, as the README says, and the target's
    decode step answers as the source's own does."""
    block = readme.example("move-grpcurl")
    script = "set -euo pipefail\n" + readme.substitute(
        block.code, {ADDRESS: embedded.address, "localhost:50052": other_embedded.address})
    prefill, imported, decode, release = json_messages(ok(readme.shell(script, tmp_path, timeout=120)))
    assert prefill["output"]["kv_cache"]["cache_id"] == "chat-7"
    assert prefill["output"]["logits"]["token_id"] == 260  # the token the Decode line appends
    assert imported["kv_cache"]["cache_id"] == "chat-7" and imported["kv_cache"]["block_table"]["sequence_length"] == 6
    assert imported["imported_tokens"] == 6 and "replayed" not in imported

    export = json_messages((tmp_path / "chat-7.export.json").read_text())
    description, chunks = export[0]["description"], [m["chunk"] for m in export[1:]]
    assert description["cache_id"] == "chat-7" and description["token_ids"] == MOVED_PROMPT
    assert description["end_position"] == description["cache_length"] == 6
    sizes = [len(base64.b64decode(c["key"])) + len(base64.b64decode(c["value"])) for c in chunks]
    # The README's comment: one chunk, 270 KiB.
    assert description["num_chunks"] == len(chunks) == 1 and int(description["total_bytes"]) == sum(sizes) == 270 * 1024
    sent = [json.loads(x) for x in (tmp_path / "chat-7.import.json").read_text().splitlines()]
    assert sent == [{"start": {"description": description, "cache_id": "chat-7"}}] + [{"chunk": c} for c in chunks]

    with ExecutorClient(embedded.address) as source, ExecutorClient(other_embedded.address) as target:
        assert release["released"] is True and "chat-7" not in [c.cache_id for c in source.list_caches()]
        (moved,) = target.list_caches(["chat-7"])
        assert moved.sequence_length == 7  # the imported 6 and the decoded token
        # The source's own answer to the same step, computed from scratch.
        out = source.prefill(PrefillInput(MOVED_PROMPT, logits_policy=LogitsPolicy.argmax()))
        step = source.decode(DecodeInput(260, out.kv_cache, logits_policy=LogitsPolicy.top_k(3)))
        source.release_cache(step.kv_cache)
        target.release_cache("chat-7")
    logits = decode["output"]["logits"]
    assert logits["top_token_ids"] == step.logits.top_token_ids.tolist()
    # Not bit for bit: each server times its float32 weight layouts at load
    # (executors/models/cpu_layout.py), and two may sum in different orders.
    assert logits["top_logprobs"] == pytest.approx(step.logits.top_logprobs.tolist(), abs=1e-4)


def test_example_list_and_release(fresh_embedded, tmp_path):
    readme.run_console(readme.example("list-and-release"), {ADDRESS: fresh_embedded.address}, tmp_path)


def test_example_move_cache(embedded, other_embedded, tmp_path):
    code = readme.substitute(readme.example("move-cache").code,
                             {ADDRESS: embedded.address, "localhost:50052": other_embedded.address})
    out = ok(run_python(code, tmp_path, prelude=f"prompt_ids = {MOVED_PROMPT}\n"))
    assert out.split() == ["chat-8", "6", "1", str(270 * 1024)]  # id, length, rounds, K and V bytes
    with ExecutorClient(embedded.address) as source, ExecutorClient(other_embedded.address) as target:
        assert "chat-8" not in [c.cache_id for c in source.list_caches()]
        (moved,) = target.list_caches(["chat-8"])
        assert moved.sequence_length == 6
        target.release_cache("chat-8")


# -- LoRA ------------------------------------------------------------------------------------
def test_example_lora(smollm2_dir, tmp_path):
    from bench.lora import random_lora_source

    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    running = start_server(llm_config(smollm2_dir, lora_dir=str(lora_dir), max_lora_rank=16))
    try:
        for where, seed in ((lora_dir / "math", 1), (tmp_path / "my-peft-adapter", 2)):
            source = random_lora_source(running.executor, seed)
            where.mkdir()
            (where / "adapter_config.json").write_bytes(source.config_json)
            (where / "adapter_model.safetensors").write_bytes(source.safetensors)
        code = readme.substitute(readme.example("lora").code, {ADDRESS: running.address})
        out = ok(run_python(code, tmp_path, prelude="prompt_ids = [1, 2, 3, 4]\n"))
        assert sorted(ast.literal_eval(out.strip())) == [("code", 16, 1), ("math", 16, 0)]
    finally:
        running.stop()


# -- security and logs -----------------------------------------------------------------------
@pytest.fixture
def pki_here(tmp_path):
    """The README's file names in a folder of their own: ca.pem, server.pem, server.key,
    clients-ca.pem (the same CA), client.pem, client.key."""
    (tmp_path / "made").mkdir()
    pki = make_pki(tmp_path / "made")
    for src, name in ((pki.ca, "ca.pem"), (pki.ca, "clients-ca.pem"), (pki.server_cert, "server.pem"),
                      (pki.server_key, "server.key"), (pki.client_cert, "client.pem"), (pki.client_key, "client.key")):
        shutil.copy(src, tmp_path / name)
    return tmp_path


def test_example_tls_servers(pki_here):
    """Each `python -m service` line starts a server that gets as far as serving (on a free
    port, not 50051); the other lines run as they are."""
    for line in readme.commands(readme.example("tls-servers")):
        if "python -m service" not in line:
            ok(readme.shell(line, pki_here))
            continue
        command = line + " --port 0"
        proc = subprocess.Popen(["bash", "-c", re.sub(r"(?<![\w./-])python(?= )", sys.executable, command)],
                                cwd=pki_here, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            seen = []
            for out_line in proc.stdout:
                seen.append(out_line)
                if "modelexec: serving" in out_line:
                    break
            assert any("modelexec: serving" in x for x in seen), (line, "".join(seen[-20:]))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def tls_server(pki_here: Path, token: str, **overrides):
    tokens = pki_here / "tokens"
    tokens.write_text(f"alice {token}\n")
    return start_server(ServeConfig(port=0, executor="paged", host="127.0.0.1", tls_cert=str(pki_here / "server.pem"),
                                    tls_key=str(pki_here / "server.key"), auth_token_file=str(tokens), **overrides))


def test_example_tls_client(pki_here):
    token = secrets.token_hex(16)
    running = tls_server(pki_here, token, tls_client_ca=str(pki_here / "clients-ca.pem"))
    try:
        address = running.address.replace("127.0.0.1", "localhost")
        code = readme.substitute(readme.example("tls-client").code, {ADDRESS: address}, token)
        assert ok(run_python(code, pki_here)).strip() == running.executor.info().model_id
    finally:
        running.stop()


def test_example_tls_grpcurl(pki_here):
    token = secrets.token_hex(16)
    tls = tls_server(pki_here, token)
    mtls = tls_server(pki_here, token, tls_client_ca=str(pki_here / "clients-ca.pem"))
    plain = start_server(ServeConfig(port=0, executor="paged", auth_token_file=str(pki_here / "tokens")))
    try:
        for line in readme.commands(readme.example("tls-grpcurl")):
            server = plain if "-plaintext" in line else mtls if "-cert " in line else tls
            address = server.address.replace("127.0.0.1", "localhost")
            ok(readme.shell(readme.substitute(line, {ADDRESS: address}, token), pki_here, timeout=60))
    finally:
        for running in (tls, mtls, plain):
            running.stop()


def test_example_json_log(tmp_path):
    """A server with JSON logs writes one line per RPC; the README's line, field by field."""
    (shown,) = [json.loads(x) for x in readme.example("json-log").code.splitlines() if x.strip()]
    token = secrets.token_hex(16)
    (tmp_path / "tokens").write_text(f"bob {token}\n")
    sock = tmp_path / "s.sock"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service", "--executor", "paged", "--unix-socket", str(sock),
                                 "--log-format", "json", "--auth-token-file", str(tmp_path / "tokens")],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        # The socket first: a channel opened before it exists retries on gRPC's growing backoff.
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        with ExecutorClient(f"unix://{sock}", token=token) as c:
            c.wait_ready(60)
            c.stub.GetStatus(pb.GetStatusRequest(), metadata=[("x-request-id", shown["request_id"]),
                                                               ("authorization", f"Bearer {token}")], timeout=10)
        deadline = time.monotonic() + 10
        while True:
            records = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            line = next((r for r in records if r.get("request_id") == shown["request_id"]), None)
            if line is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert line is not None, log.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert set(line) == set(shown)
    for key in ("level", "logger", "method", "code", "request_id", "identity"):
        assert line[key] == shown[key], key
    assert isinstance(line["ts"], float) and isinstance(line["duration_ms"], float)
    assert line["peer"].startswith(("unix:", "ipv4:", "ipv6:"))
