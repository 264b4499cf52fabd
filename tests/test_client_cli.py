"""`python -m client`: exit statuses, credentials, interrupts, closed pipes and argument checks.

Most commands run in-process through `client.__main__.main(argv)` against the paged reference
executor (a word-level tokenizer stands in for a model's: word wN is token N); the ones that
need a real process (Ctrl-C, a closed stdout) run `python -m client` as a subprocess.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from client import AsyncExecutorClient, ExecutorClient, Penalties, PrefillInput
from client.__main__ import main
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from tests.conftest import REPO, wait_until
from tests.test_logits_adjustments import penalized_greedy


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> Path:
    """A tokenizer directory whose vocabulary is the paged executor's 256 ids, as words w0..w255."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("words")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    return d




@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv("MODELEXEC_TOKEN", raising=False)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr); argparse's exits count as statuses."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


def popen(*argv: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "client", *argv], cwd=REPO, text=True,
                            stdout=kwargs.pop("stdout", subprocess.PIPE), stderr=subprocess.PIPE, **kwargs)


def short(max_sequence_length: int = 16) -> PagedAttentionExecutor:
    return PagedAttentionExecutor(PagedExecutorConfig(block_size=4, num_blocks=64,
                                                      max_sequence_length=max_sequence_length))


class Slow(PagedAttentionExecutor):
    """Each step takes 50 ms, so a command is still running when the test interrupts it."""

    def __init__(self) -> None:
        super().__init__(PagedExecutorConfig(block_size=4, num_blocks=256))

    async def decode(self, inp):
        await asyncio.sleep(0.05)
        return await super().decode(inp)

    async def unified_decode(self, items):
        await asyncio.sleep(0.05)
        return await super().unified_decode(items)


def active_caches(address: str) -> int:
    with ExecutorClient(address, timeout=10) as c:
        return c.status().kv_pool.active_caches


# -- 1. schedule's exit status ------------------------------------------------------------------
def test_schedule_exits_1_when_a_request_failed(make_server, words, tmp_path, capsys):
    running = make_server(instance=short())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\n" + " ".join(f"w{i}" for i in range(1, 30)) + "\n")  # the 2nd is too long
    rc, out, err = cli(capsys, "--target", running.address, "schedule", "--prompts-file", str(prompts),
                       "--tokenizer", str(words), "--max-tokens", "4")
    assert "2 requests (1 failed)" in out, out
    assert rc == 1, (out, err)
    prompts.write_text("w1 w2 w3\n")
    rc, out, err = cli(capsys, "--target", running.address, "schedule", "--prompts-file", str(prompts),
                       "--tokenizer", str(words), "--max-tokens", "4")
    assert rc == 0 and "1 requests (0 failed)" in out, (out, err)


# -- 2. credentials -----------------------------------------------------------------------------
def test_a_token_from_the_flag_or_the_environment_reaches_every_client(make_server, token_file, words, tmp_path,
                                                                       capsys, monkeypatch):
    source = make_server(auth_token_file=token_file)
    target = make_server(auth_token_file=token_file)
    rc, _, err = cli(capsys, "--target", source.address, "info")
    assert rc == 1 and "UNAUTHENTICATED" in err, err
    rc, out, err = cli(capsys, "--target", source.address, "--token", "tok-alice-1", "info")
    assert rc == 0 and '"model_id"' in out, err
    monkeypatch.setenv("MODELEXEC_TOKEN", "tok-alice-1")
    rc, out, err = cli(capsys, "--target", source.address, "list-caches")
    assert rc == 0, err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw4 w5\n")
    rc, out, err = cli(capsys, "--target", source.address, "schedule", "--prompts-file", str(prompts),
                       "--tokenizer", str(words), "--max-tokens", "3")
    assert rc == 0 and "2 requests (0 failed)" in out, (out, err)
    with ExecutorClient(source.address, timeout=10, token="tok-alice-1") as alice:
        handle = alice.prefill(PrefillInput([1, 2, 3, 4, 5])).kv_cache
        rc, out, err = cli(capsys, "--target", source.address, "drain", "--to", target.address, "--keep-running")
        assert rc == 0 and f"moved {handle.cache_id} -> {target.address}" in out, (out, err)
        assert alice.list_caches() == []
    with ExecutorClient(target.address, timeout=10, token="tok-alice-1") as alice:
        assert [c.cache_id for c in alice.list_caches()] == [handle.cache_id]
        alice.release_cache(handle.cache_id)
    # The flag wins over the environment.
    rc, _, err = cli(capsys, "--target", source.address, "--token", "tok-wrong", "info")
    assert rc == 1 and "UNAUTHENTICATED" in err, err


def test_tls_and_mutual_tls_flags(make_server, pki, words, tmp_path, capsys):
    running = make_server(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))
    target = f"localhost:{running.address.rsplit(':', 1)[1]}"
    mtls = ["--ca", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    rc, out, err = cli(capsys, "--target", target, *mtls, "status")
    assert rc == 0 and '"kv_pool"' in out, err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\n")
    rc, out, err = cli(capsys, "--target", target, *mtls, "schedule", "--prompts-file", str(prompts),
                       "--tokenizer", str(words), "--max-tokens", "3")
    assert rc == 0 and "1 requests (0 failed)" in out, (out, err)
    rc, _, err = cli(capsys, "--target", target, "--timeout", "5", "--ca", str(pki.ca), "status")
    assert rc == 1 and "UNAVAILABLE" in err, err  # no client certificate: the handshake fails
    rc, _, err = cli(capsys, "--target", target, "--ca", str(pki.ca), "--cert", str(pki.client_cert), "status")
    assert rc == 2 and "--cert" in err and "--key" in err, err
    rc, _, err = cli(capsys, "--target", target, "--ca", str(tmp_path / "nope.pem"), "status")
    assert rc == 1 and "--ca" in err and "nope.pem" in err and "Traceback" not in err, err


# -- 3. drain against a source that refuses Shutdown ------------------------------------------
def test_drain_reports_the_moves_when_the_source_refuses_to_shut_down(make_server, capsys):
    source, target = make_server(), make_server()  # no --allow-shutdown
    with ExecutorClient(source.address, timeout=10) as a:
        handles = [a.prefill(PrefillInput(p)).kv_cache for p in ([1, 2, 3], [4, 5, 6, 7])]
        rc, out, err = cli(capsys, "--target", source.address, "drain", "--to", target.address)
        assert rc == 1, (out, err)
        for h in handles:
            assert f"moved {h.cache_id} -> {target.address}" in out, out
        assert "2 caches moved" in out and "0 failed" in out and "left running" in out, out
        assert "PERMISSION_DENIED" in err, err
        assert a.list_caches() == [] and a.status()  # still up
        c = a.prefill(PrefillInput([9, 9])).kv_cache

        async def library():
            async with AsyncExecutorClient(source.address) as s, AsyncExecutorClient(target.address) as t:
                from client.drain import drain

                return await drain(s, [t])

        report = asyncio.run(library())
        assert report.moved == {c.cache_id: 0} and not report.shut_down
        assert report.shutdown_error is not None and report.shutdown_error.code.name == "PERMISSION_DENIED"
    with ExecutorClient(target.address, timeout=10) as b:
        assert sorted(i.cache_id for i in b.list_caches()) == sorted([*(h.cache_id for h in handles), c.cache_id])
        for i in b.list_caches():
            b.release_cache(i.cache_id)


# -- 4. Ctrl-C and closed pipes -----------------------------------------------------------------
def interrupted(proc: subprocess.Popen, ready: Callable[[], bool]) -> tuple[str, str]:
    """Ctrl-C (SIGINT) to `proc` once `ready()`; then its (stdout, stderr). It never outlives this."""
    try:
        wait_until(ready, timeout=20, poll=0.02)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_during_generate_exits_130_quietly_and_releases_the_cache(make_server, words):
    running = make_server(instance=Slow())
    proc = popen("--target", running.address, "generate", "--prompt", "w1 w2 w3", "--tokenizer", str(words),
                 "--max-tokens", "400", "--ignore-eos")
    prompt_shown = proc.stdout.read(1)  # the prompt: the prefill is done
    out, err = interrupted(proc, lambda: active_caches(running.address) == 1)
    assert prompt_shown and proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert out.endswith("\n")
    assert active_caches(running.address) == 0


def test_ctrl_c_during_schedule_exits_130_quietly_and_releases_the_caches(make_server, words, tmp_path):
    running = make_server(instance=Slow())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw4 w5\nw6 w7 w8 w9\n")
    proc = popen("--target", running.address, "schedule", "--prompts-file", str(prompts), "--tokenizer", str(words),
                 "--max-tokens", "400", "--ignore-eos")
    _, err = interrupted(proc, lambda: active_caches(running.address) == 3)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    wait_until(lambda: active_caches(running.address) == 0, timeout=5, poll=0.02)


class SlowImports(PagedAttentionExecutor):
    """The first four imports land; every later one waits until its call is cancelled. A drain
    (four moves at a time) is then still moving when it is interrupted, however long the
    interruption takes to arrive on a busy machine."""

    def __init__(self) -> None:
        super().__init__(PagedExecutorConfig(block_size=4, num_blocks=256))
        self.imports_begun = 0

    async def import_kv(self, description, cache_id):
        self.imports_begun += 1
        if self.imports_begun > 4:
            await asyncio.Event().wait()
        return await super().import_kv(description, cache_id)


def test_ctrl_c_during_drain_says_where_the_moved_caches_went_and_loses_none(make_server):
    """Two rounds of moves (four at a time): Ctrl-C while the second cannot land. The caches
    already moved are printed, and every cache is on exactly one of the two servers."""
    source, target = make_server(), make_server(instance=SlowImports())
    with ExecutorClient(source.address, timeout=10) as a:
        ids = {a.prefill(PrefillInput([i + 1, i + 2, i + 3])).kv_cache.cache_id for i in range(6)}
    proc = popen("--target", source.address, "drain", "--to", target.address)
    out, err = interrupted(proc, lambda: active_caches(target.address) >= 1)
    assert proc.returncode == 130 and "Traceback" not in err, err
    printed = {line.split()[1] for line in out.splitlines() if line.startswith("moved ")}
    with ExecutorClient(source.address, timeout=10) as a, ExecutorClient(target.address, timeout=10) as b:
        left, there = {i.cache_id for i in a.list_caches()}, {i.cache_id for i in b.list_caches()}
    assert printed == there and there and left and not left & there and left | there == ids, (out, left, there)
    assert f"interrupted: {len(there)} caches moved" in err, err


def closed_stdout(*argv: str) -> tuple[int, str]:
    """Run the CLI with a stdout whose reader is gone before anything is written (`| head -c 0`)."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = popen(*argv, stdout=w)
    finally:
        os.close(w)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_a_closed_stdout_is_no_traceback(paged_server, words):
    rc, err = closed_stdout("--target", paged_server.address, "info")
    assert rc == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    rc, err = closed_stdout("--target", paged_server.address, "generate", "--prompt", "w1 w2", "--tokenizer",
                            str(words), "--max-tokens", "5")
    assert rc == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert active_caches(paged_server.address) == 0


# -- 5. health ------------------------------------------------------------------------------------
def test_health_exits_1_unless_serving(make_server, capsys):
    cold = make_server(warmup_on_start=False)  # NOT_SERVING until a Warmup call
    rc, out, _ = cli(capsys, "--target", cold.address, "health")
    assert '"NOT_SERVING"' in out and rc == 1, out
    serving = make_server()
    rc, out, _ = cli(capsys, "--target", serving.address, "health")
    assert '"SERVING"' in out and rc == 0, out


# -- 6. flags that would be ignored or out of range ---------------------------------------------
@pytest.mark.parametrize("argv,flag", [
    (["generate", "--top-p", "0.9"], "--top-p"),
    (["generate", "--top-k", "5"], "--top-k"),
    (["generate", "--seed", "1"], "--seed"),
    (["generate", "--system", "be brief"], "--system"),
    (["generate", "--temperature", "-1"], "--temperature"),
    (["generate", "--temperature", "nan"], "--temperature"),
    (["generate", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--temperature", "1", "--seed", "-1"], "--seed"),
    (["generate", "--temperature", "1", "--seed", str(2**64)], "--seed"),
    (["generate", "--temperature", "1", "--top-k", "-1"], "--top-k"),
    (["generate", "--temperature", "1", "--top-p", "1.5"], "--top-p"),
    (["generate", "--min-p", "0.1"], "--min-p"),
    (["generate", "--temperature", "1", "--min-p", "1.5"], "--min-p"),
    (["generate", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["generate", "--repetition-penalty", "inf"], "--repetition-penalty"),
    (["generate", "--presence-penalty", "2.5"], "--presence-penalty"),
    (["generate", "--frequency-penalty", "nan"], "--frequency-penalty"),
    (["schedule", "--temperature", "-1"], "--temperature"),
    (["schedule", "--max-tokens", "0"], "--max-tokens"),
    (["schedule", "--temperature", "0.5", "--seed", "-3"], "--seed"),
    (["schedule", "--seed", "3"], "--seed"),
    (["schedule", "--top-p", "0.5"], "--top-p"),
    (["generate", "--min-tokens", "9", "--max-tokens", "5"], "--min-tokens"),
    (["schedule", "--min-tokens", "-1"], "--min-tokens"),
    (["schedule", "--temperature", "1", "--min-p", "-0.1"], "--min-p"),
    (["schedule", "--frequency-penalty", "-3"], "--frequency-penalty"),
    (["schedule", "--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_flags_that_would_be_ignored_or_are_out_of_range_are_refused(argv, flag, words, tmp_path, capsys):
    extra = (["--prompt", "w1"] if argv[0] == "generate" else ["--prompts-file", str(tmp_path / "none.txt")])
    rc, out, err = cli(capsys, "--target", "localhost:1", "--timeout", "2", *argv, *extra,
                       "--tokenizer", str(words))
    assert rc == 2, (out, err)
    assert flag in err and "Value out of range" not in err, err
    assert out == ""


def test_sampling_flags_are_passed_on(paged_server, words, tmp_path, capsys):
    rc, out, err = cli(capsys, "--target", paged_server.address, "generate", "--prompt", "w1 w2", "--tokenizer",
                       str(words), "--max-tokens", "3", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9",
                       "--seed", "7")
    assert rc == 0 and out.startswith("w1 w2") and out.endswith("\n"), (out, err)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2\n")
    rc, out, err = cli(capsys, "--target", paged_server.address, "schedule", "--prompts-file", str(prompts),
                       "--tokenizer", str(words), "--max-tokens", "3", "--temperature", "0.5", "--seed", "3")
    assert rc == 0 and "(0 failed)" in out, (out, err)
    rc, out, err = cli(capsys, "--target", paged_server.address, "schedule", "--prompts-file", str(prompts),
                       "--tokenizer", str(words), "--max-tokens", "3", "--temperature", "0.5", "--top-k", "9",
                       "--top-p", "0.9", "--min-p", "0.1", "--repetition-penalty", "1.2", "--presence-penalty", "1",
                       "--frequency-penalty", "0.5")
    assert rc == 0 and "(0 failed)" in out, (out, err)


def test_generate_applies_penalties_over_its_own_tokens(paged_server, words, capsys):
    penalties = Penalties(repetition=1.3, presence=1.5, frequency=0.5)
    expected = penalized_greedy([1, 2], 12, penalties)
    assert expected != penalized_greedy([1, 2], 12, Penalties()), "the penalties should change the tokens"
    rc, out, err = cli(capsys, "--target", paged_server.address, "generate", "--prompt", "w1 w2", "--tokenizer",
                       str(words), "--max-tokens", "12", "--ignore-eos", "--repetition-penalty", "1.3",
                       "--presence-penalty", "1.5", "--frequency-penalty", "0.5")
    assert rc == 0, err
    assert out == "w1 w2" + " ".join(f"w{t}" for t in expected) + "\n", out  # the new text follows the prompt
    rc, out, err = cli(capsys, "--target", paged_server.address, "generate", "--prompt", "w1 w2", "--tokenizer",
                       str(words), "--max-tokens", "4", "--temperature", "0.8", "--min-p", "0.5", "--seed", "3",
                       "--presence-penalty", "-1")
    assert rc == 0 and out.startswith("w1 w2"), (out, err)


def test_schedule_applies_penalties_over_each_prompts_own_tokens(paged_server, words, tmp_path, capsys):
    penalties = Penalties(repetition=1.3, presence=1.5, frequency=0.5)
    prompts = [[1, 2], [7, 9, 11]]
    (tmp_path / "p.txt").write_text("".join(" ".join(f"w{t}" for t in p) + "\n" for p in prompts))
    rc, out, err = cli(capsys, "--target", paged_server.address, "schedule", "--prompts-file", str(tmp_path / "p.txt"),
                       "--tokenizer", str(words), "--max-tokens", "10", "--ignore-eos", "--repetition-penalty", "1.3",
                       "--presence-penalty", "1.5", "--frequency-penalty", "0.5")
    assert rc == 0, (out, err)
    for prompt in prompts:  # each completion printed on the line after its prompt's
        expected = " ".join(f"w{t}" for t in penalized_greedy(prompt, 10, penalties))
        assert f"{' '.join(f'w{t}' for t in prompt)}\n{expected}\n" in out, out


# -- 7. generate's output and errors ------------------------------------------------------------
def test_generate_prints_the_prompt_only_once_the_prefill_succeeded(words, capsys):
    with socket_nobody_listens_on() as address:
        rc, out, err = cli(capsys, "--target", address, "--timeout", "5", "generate", "--prompt", "w1 w2",
                           "--tokenizer", str(words))
    assert rc == 1 and out == "" and err.startswith("error: UNAVAILABLE"), (out, err)


def test_an_error_mid_generation_starts_on_a_line_of_its_own(make_server, words, capsys):
    running = make_server(instance=short(16))
    rc, out, err = cli(capsys, "--target", running.address, "generate", "--prompt", "w1 w2 w3", "--tokenizer",
                       str(words), "--max-tokens", "40", "--ignore-eos")
    assert rc == 1 and out.startswith("w1 w2 w3") and out.endswith("\n"), (out, err)
    assert err.startswith("error: "), err
    assert active_caches(running.address) == 0


class socket_nobody_listens_on:
    """A loopback address bound but not listening: connections to it are refused."""

    def __enter__(self) -> str:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()


# -- 8. unreadable prompt files -------------------------------------------------------------------
def test_a_prompts_file_that_is_a_directory_is_a_clear_error(words, tmp_path, capsys):
    rc, _, err = cli(capsys, "--target", "localhost:1", "schedule", "--prompts-file", str(tmp_path),
                       "--tokenizer", str(words))
    assert rc == 1 and err.startswith("error: ") and str(tmp_path) in err and "directory" in err.lower(), err
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00w1\n")
    rc, _, err = cli(capsys, "--target", "localhost:1", "schedule", "--prompts-file", str(tmp_path / "binary"),
                       "--tokenizer", str(words))
    assert rc == 1 and err.startswith("error: ") and "UTF-8" in err, err


# -- 9. installed as modelexec-client ---------------------------------------------------------
def test_help_names_the_program_it_runs_as(monkeypatch, capsys, tmp_path):
    import client.tokenizer

    monkeypatch.setattr(sys, "argv", ["/venv/bin/modelexec-client"])
    monkeypatch.setattr(client.tokenizer, "DEFAULT_TOKENIZER_DIR", tmp_path / "models" / "absent")
    rc, out, _ = cli(capsys, "--help")
    assert rc == 0 and out.startswith("usage: modelexec-client") and "python -m client" not in out, out
    rc, out, _ = cli(capsys, "generate", "--help")
    assert rc == 0 and out.startswith("usage: modelexec-client generate"), out
    assert "no default" in " ".join(out.split()), out  # no embedded model next to an installed client
    rc, out, err = cli(capsys, "--target", "localhost:1", "generate", "--prompt", "w1")
    assert rc == 1 and "--tokenizer" in err and "Traceback" not in err, err


def test_help_in_the_checkout_says_python_m_client():
    done = subprocess.run([sys.executable, "-m", "client", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m client"), done.stdout
    assert "--token" in done.stdout and "MODELEXEC_TOKEN" in done.stdout
