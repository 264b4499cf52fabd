"""Prometheus metrics, request ids and the per-RPC JSON log line, against real servers."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.service_process import free_port
from client import (
    DecodeInput,
    ExecutorClient,
    NotFoundError,
    PrefillInput,
    UnauthenticatedError,
    UnifiedBatchItem,
)
from generated.modelexec.v1 import executor_pb2 as pb
from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc
from service.config import parse_args
from service.logs import JsonFormatter, configure_logging
from service.observability import request_id

SERVICE = "modelexec.v1.ModelExecutorService"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_metrics_endpoint_serves_the_series(make_server):
    port = free_port()
    running = make_server(metrics_port=port, num_blocks=64)
    assert running.server.metrics_port == port
    with ExecutorClient(running.address, timeout=10) as c:
        a = c.prefill(PrefillInput([1, 2, 3, 4, 5]))
        b = c.prefill(PrefillInput([6, 7]))
        steps = c.batch_decode([DecodeInput(8, a.kv_cache), DecodeInput(9, b.kv_cache)])
        d = c.decode(DecodeInput(10, steps[0].kv_cache))
        c.unified_decode([UnifiedBatchItem(b.kv_cache.cache_id, [11], 3, True),
                          UnifiedBatchItem("fresh", [1, 2, 3, 4], 0, True)])
        c.forward_verify(d.kv_cache, [1, 2])
        with pytest.raises(NotFoundError):
            c.truncate_kv("never-made", 1)
        status = c.status()
    running.server.on_leases_expired(3)  # the lease reaper's hook

    wait_for_records(8)  # a failed call's status reaches the client just before the server books it
    m = scrape(port)
    req = "modelexec_rpc_requests_total"
    assert m[(req, (("code", "OK"), ("method", f"{SERVICE}/Prefill")))] == 2
    assert m[(req, (("code", "OK"), ("method", f"{SERVICE}/BatchDecode")))] == 1
    assert m[(req, (("code", "NOT_FOUND"), ("method", f"{SERVICE}/TruncateKv")))] == 1
    assert m[("modelexec_rpc_duration_seconds_count", (("code", "OK"), ("method", f"{SERVICE}/Prefill")))] == 2
    assert m[("modelexec_rpc_duration_seconds_sum", (("code", "OK"), ("method", f"{SERVICE}/Prefill")))] > 0
    assert m[("modelexec_rpc_duration_seconds_bucket",
              (("code", "OK"), ("le", "+Inf"), ("method", f"{SERVICE}/Prefill")))] == 2
    # Tokens: prefill 5 + 2 + the unified chunk's 4; decode 2 (batch) + 1 + 1 (unified); verify 2.
    assert m[("modelexec_tokens_processed_total", (("kind", "prefill"),))] == 11
    assert m[("modelexec_tokens_processed_total", (("kind", "decode"),))] == 4
    assert m[("modelexec_tokens_processed_total", (("kind", "verify"),))] == 2
    assert m[("modelexec_batch_items_count", (("method", "BatchDecode"),))] == 1
    assert m[("modelexec_batch_items_sum", (("method", "UnifiedDecode"),))] == 2
    assert m[("modelexec_kv_blocks_used", ())] == status.kv_pool.used_blocks > 0
    assert m[("modelexec_kv_blocks_free", ())] == status.kv_pool.free_blocks == 64 - status.kv_pool.used_blocks
    assert m[("modelexec_kv_blocks_total", ())] == 64
    assert m[("modelexec_kv_active_caches", ())] == status.kv_pool.active_caches == 3
    assert m[("modelexec_kv_leases_expired_total", ())] == 3
    assert m[("modelexec_rpc_in_flight", ())] == 0
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
    assert missing.value.code == 404


def test_metrics_are_off_by_default_and_per_server(make_server):
    plain = make_server()
    assert plain.server.metrics_port == 0
    port = free_port()
    second = make_server(metrics_port=port)  # a registry of its own: no clash with other servers
    with ExecutorClient(plain.address, timeout=10) as c:
        c.info()
    with ExecutorClient(second.address, timeout=10) as c:
        c.info()
        c.info()
    assert scrape(port)[("modelexec_rpc_requests_total", (("code", "OK"), ("method", f"{SERVICE}/GetInfo")))] == 2


def test_auth_refusals_are_counted_and_logged(make_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("carol tok-carol\n")
    port = free_port()
    running = make_server(metrics_port=port, auth_token_file=str(tokens))
    with ExecutorClient(running.address, timeout=10) as c, pytest.raises(UnauthenticatedError):
        c.info()
    with ExecutorClient(running.address, timeout=10, token="tok-carol",
                        call_metadata=[("x-request-id", "carol-1")]) as c:
        c.info()
    lines = wait_for_records(2)
    m = scrape(port)
    assert m[("modelexec_rpc_requests_total", (("code", "UNAUTHENTICATED"), ("method", f"{SERVICE}/GetInfo")))] == 1
    refused = [line for line in lines if line["code"] == "UNAUTHENTICATED"]
    assert len(refused) == 1 and refused[0]["identity"] is None
    ok = next(line for line in lines if line["request_id"] == "carol-1")
    assert ok["identity"] == "carol" and ok["code"] == "OK" and ok["method"] == f"{SERVICE}/GetInfo"


_RECORDS: list[logging.LogRecord] = []


def _records() -> list[dict]:
    formatter = JsonFormatter()
    return [json.loads(formatter.format(r)) for r in list(_RECORDS)]


def wait_for_records(count: int, timeout: float = 5.0) -> list[dict]:
    """The log lines once `count` are in: an error status is sent before its RPC's line is written."""
    deadline = time.monotonic() + timeout
    while len(_RECORDS) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _records()


@pytest.fixture(autouse=True)
def _capture_rpc_records() -> Iterator[None]:
    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _RECORDS.append(record)

    logger = logging.getLogger("modelexec.rpc")  # every RPC, as JSON logging keeps them
    handler, old_level = Keep(logging.DEBUG), logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    _RECORDS.clear()
    yield
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_request_ids_are_echoed_and_logged(make_server):
    running = make_server()
    with grpc.insecure_channel(running.address) as channel:
        stub = pb_grpc.ModelExecutorServiceStub(channel)
        _, call = stub.GetInfo.with_call(pb.GetInfoRequest(), metadata=[("x-request-id", "req-given-42")], timeout=10)
        assert dict(call.initial_metadata())["x-request-id"] == "req-given-42"
        _, call = stub.GetInfo.with_call(pb.GetInfoRequest(), timeout=10)
        generated = dict(call.initial_metadata())["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated)
        with pytest.raises(grpc.RpcError) as failed:
            stub.TruncateKv(pb.TruncateKvRequest(cache_id="never-made"), timeout=10,
                            metadata=[("x-request-id", "req-failing-7")])
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert dict(failed.value.initial_metadata())["x-request-id"] == "req-failing-7"
        # A value that is not a sane id is replaced, not echoed.
        _, call = stub.GetInfo.with_call(pb.GetInfoRequest(), metadata=[("x-request-id", "x" * 500)], timeout=10)
        assert re.fullmatch(r"[0-9a-f]{32}", dict(call.initial_metadata())["x-request-id"])

    async def aio() -> str:
        async with grpc.aio.insecure_channel(running.address) as ch:
            stub = pb_grpc.ModelExecutorServiceStub(ch)
            call = stub.Decode(pb.DecodeRequest(), metadata=(("x-request-id", "req-aio-9"),), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert dict(err.value.initial_metadata())["x-request-id"] == "req-aio-9"
            return err.value.code().name

    code = asyncio.run(aio())
    lines = {line["request_id"]: line for line in wait_for_records(5)}
    given = lines["req-given-42"]
    assert given["method"] == f"{SERVICE}/GetInfo" and given["code"] == "OK" and given["identity"] is None
    assert given["duration_ms"] >= 0 and given["peer"].startswith("ipv4:127.0.0.1:")
    assert given["level"] == "DEBUG" and given["logger"] == "modelexec.rpc"  # successes: DEBUG, errors: INFO
    assert lines[generated]["code"] == "OK"
    assert lines["req-failing-7"]["code"] == "NOT_FOUND" and lines["req-failing-7"]["level"] == "INFO"
    assert lines["req-aio-9"]["code"] == code == "INVALID_ARGUMENT"


def test_health_and_reflection_calls_get_request_ids_too(make_server):
    running = make_server()
    with ExecutorClient(running.address, timeout=10, call_metadata=[("x-request-id", "health-1")]) as c:
        c.health()
    line = next(r for r in _records() if r["request_id"] == "health-1")
    assert line["method"] == "grpc.health.v1.Health/Check" and line["code"] == "OK"


def test_log_format_flag_and_json_lines(capsys):
    assert parse_args([]).log_format == "text" and parse_args(["--log-format", "json"]).log_format == "json"
    assert parse_args(["--metrics-port", "9100"]).metrics_port == 9100
    with pytest.raises(SystemExit):
        parse_args(["--metrics-port", "70000"])
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("json")
        logging.getLogger("modelexec.test").warning("hello %s", "world")
        configure_logging("text")
        logging.getLogger("modelexec.test").warning("plain")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    err = capsys.readouterr().err.splitlines()
    first = json.loads(next(line for line in err if "hello" in line))
    assert first["message"] == "hello world" and first["level"] == "WARNING" and first["logger"] == "modelexec.test"
    assert any(line.endswith("WARNING modelexec.test: plain") for line in err)
    assert request_id([("x-request-id", "abc-1")]) == "abc-1" and len(request_id(None)) == 32


def test_step_session_steps_are_booked_like_unified_calls(make_server):
    port = free_port()
    running = make_server(metrics_port=port)
    with ExecutorClient(running.address, timeout=10) as c:
        with c.step_session() as session:
            first = session.step([UnifiedBatchItem("s1", [1, 2, 3], 0, True), UnifiedBatchItem("s2", [4], 0, True)])
            session.step([UnifiedBatchItem("s1", [5], 3, True)])
            with pytest.raises(NotFoundError):
                session.step([UnifiedBatchItem("nobody", [5], 3, True)])  # a failed step books nothing
        assert first[0].kv_cache.sequence_length == 3
    wait_for_records(1)
    m = scrape(port)
    assert m[("modelexec_rpc_requests_total", (("code", "OK"), ("method", f"{SERVICE}/StepSession")))] == 1
    assert m[("modelexec_batch_items_count", (("method", "StepSession"),))] == 2
    assert m[("modelexec_batch_items_sum", (("method", "StepSession"),))] == 3
    assert m[("modelexec_tokens_processed_total", (("kind", "prefill"),))] == 4
    assert m[("modelexec_tokens_processed_total", (("kind", "decode"),))] == 1
