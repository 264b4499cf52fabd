"""The TypeScript client (client/typescript): generated from protos/ at test time (buf +
ts-proto), compiled with tsc, and its demo run against a real server; its move script
moves a cache between two real servers (ExportKv into ImportKv, ListCaches, ReleaseCache
with expectedLength).

Its npm packages come from the committed package-lock.json (`make install-test` runs
`npm ci`); the generated code is not checked in, so it cannot go stale. The build runs in
a temporary copy of the package (sharing its node_modules), so that test runs side by
side never write into the working tree or into each other's build.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput
from tests.paged_reference import PagedModel

REPO = Path(__file__).resolve().parent.parent
TS = REPO / "client" / "typescript"
PROTO = REPO / "protos" / "modelexec" / "v1" / "executor.proto"


def npm(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("npm")
    if exe is None:
        pytest.fail("npm is not on PATH: the TypeScript client needs Node.js 20+ and npm")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`npm run build` (buf generate with ts-proto into src/gen/, then tsc into dist/) in a
    copy of the package laid out as in the repository: <tmp>/protos, <tmp>/client/typescript."""
    if not (TS / "node_modules" / ".bin" / "tsc").exists():
        pytest.fail("client/typescript/node_modules is missing: run `make install-test` (npm ci)")
    root = tmp_path_factory.mktemp("ts-client")
    shutil.copytree(REPO / "protos", root / "protos")
    package = root / "client" / "typescript"
    package.mkdir(parents=True)
    for name in ("package.json", "package-lock.json", "tsconfig.json", "buf.gen.yaml"):
        shutil.copy(TS / name, package / name)
    shutil.copytree(TS / "src", package / "src", ignore=shutil.ignore_patterns("gen"))
    (package / "node_modules").symlink_to(TS / "node_modules", target_is_directory=True)
    out = npm(package, "run", "--silent", "build")
    assert out.returncode == 0, f"npm run build failed:\n{out.stdout}{out.stderr}"
    assert (package / "dist" / "demo.js").exists() and (package / "dist" / "move.js").exists()
    return package


def run_demo(package: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return npm(package, "run", "--silent", "demo", "--", *args, timeout=60)


def steps(stdout: str) -> dict[str, dict]:
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {r["step"]: r for r in records}


def test_generated_client_has_every_rpc(built: Path) -> None:
    rpcs = re.findall(r"^\s*rpc\s+(\w+)\s*\(", PROTO.read_text(), re.MULTILINE)
    generated = (built / "src" / "gen" / "modelexec" / "v1" / "executor.ts").read_text()
    assert rpcs
    missing = [r for r in rpcs if f'path: "/modelexec.v1.ModelExecutorService/{r}"' not in generated]
    assert not missing, f"RPCs missing from the generated TypeScript client: {missing}"


def test_demo_prefill_decode_release(built: Path, make_server) -> None:
    server = make_server()
    out = run_demo(built, server.address, "--prompt", "1,2,3")
    assert out.returncode == 0, f"demo failed:\n{out.stdout}{out.stderr}"
    s = steps(out.stdout)
    assert list(s) == ["info", "prefill", "decode", "release", "constrained", "status"], out.stdout

    vocab = s["info"]["vocabSize"]
    assert vocab == 256 and s["info"]["modelId"]
    prefill, decode = s["prefill"], s["decode"]
    assert prefill["cacheId"] and decode["cacheId"] == prefill["cacheId"]
    assert (prefill["sequenceLength"], decode["sequenceLength"]) == (3, 4)
    assert prefill["blockIds"] and prefill["blockSize"] == 4 and prefill["heldBlocks"] == len(prefill["blockIds"])
    assert decode["blockIds"] == [] and decode["heldBlocks"] == 1  # asked for compact: the count, no ids
    for step in (prefill, decode):
        assert 0 <= step["tokenId"] < vocab
        assert step["logprob"] <= 0 and math.isfinite(step["logprob"])
        # uint64 timings arrive as bigint, printed as decimal strings (protobuf JSON style).
        assert int(step["timing"]["totalNs"]) >= int(step["timing"]["executorNs"]) > 0
    assert s["release"] == {"step": "release", "cacheId": prefill["cacheId"], "released": True,
                            "freedBlocks": decode["heldBlocks"]}
    assert s["status"]["freeBlocks"] == s["status"]["totalBlocks"] == 256
    assert s["status"]["activeCaches"] == 0

    with ExecutorClient(server.address, timeout=30) as ex:
        pool = ex.status().kv_pool
        assert pool.free_blocks == pool.total_blocks and pool.used_blocks == 0 and pool.active_caches == 0
        # The same prompt through the Python client: the same argmax token and log-prob.
        py = ex.prefill(PrefillInput([1, 2, 3], logits_policy=LogitsPolicy.argmax()))
        ex.release_cache(py.kv_cache)
    assert py.logits.token_id == prefill["tokenId"]
    assert py.logits.logprob == pytest.approx(prefill["logprob"], abs=1e-5)

    # The constrained step: the argmax of the paged model's row over ids 7-9, 8 biased by 5,
    # with the model's own three most likely ids and log-probabilities.
    row = PagedModel().last_logits([1, 2, 3]).astype(np.float64)
    chosen = 7 + int(np.argmax(row[7:10] + np.array([0.0, 5.0, 0.0])))
    logprobs = row - np.log(np.exp(row - row.max()).sum()) - row.max()
    constrained = s["constrained"]
    assert constrained["tokenId"] == chosen
    assert constrained["logprob"] == pytest.approx(logprobs[chosen], abs=1e-5)
    np.testing.assert_allclose(constrained["topLogprobs"], np.sort(logprobs)[::-1][:3], atol=1e-5)
    assert [logprobs[t] for t in constrained["topTokenIds"]] == pytest.approx(constrained["topLogprobs"], abs=1e-5)


def test_demo_reports_a_refused_call(built: Path, make_server) -> None:
    server = make_server()
    out = run_demo(built, server.address, "--prompt", "1,999")  # 999 is outside the vocabulary (256)
    assert out.returncode == 1, out.stdout + out.stderr
    error = json.loads([line for line in out.stderr.splitlines() if line.startswith("{")][-1])
    assert error["error"] == "INVALID_ARGUMENT" and error["code"] == 3
    assert "info" in steps(out.stdout) and "prefill" not in steps(out.stdout)
    with ExecutorClient(server.address, timeout=30) as ex:
        assert ex.status().kv_pool.active_caches == 0


def test_move_a_cache_between_two_servers(built: Path, make_server) -> None:
    """npm run move: a prefill on one server, its ExportKv stream piped into ImportKv on a
    second one (another block size), a replayed import, one decode step on both copies
    with equal full logits, ListCaches, ReleaseCache refused for a wrong expectedLength,
    stream errors; then every pool is free again (no export snapshot left behind)."""
    source = make_server()  # block size 4
    target = make_server(block_size=8)  # the importer lays the cache out in blocks of its own size
    small = make_server(num_blocks=2)  # cannot hold the cache: the import is refused mid-stream
    prompt = list(range(1, 11))
    out = npm(built, "run", "--silent", "move", "--", source.address, target.address, "--prompt",
              ",".join(map(str, prompt)), "--max-chunk-bytes", "600", "--small-target", small.address, timeout=120)
    assert out.returncode == 0, f"move failed:\n{out.stdout}{out.stderr}"
    s = steps(out.stdout)
    assert list(s) == ["prefill", "export", "import", "replay", "decode", "list", "stale-release", "release",
                       "export-missing", "import-missing", "import-exhausted", "cleanup"], out.stdout

    with ExecutorClient(source.address, timeout=30) as ex:
        info = ex.info()
    # K and V of every position of every layer, float32.
    kv_bytes = len(prompt) * info.num_layers * 2 * info.num_kv_heads * info.head_dim * 4

    prefill, export = s["prefill"], s["export"]
    assert prefill["sequenceLength"] == len(prompt) and prefill["blockSize"] == 4
    description = export["description"]
    assert description == {"cacheId": prefill["cacheId"], "startPosition": 0, "endPosition": len(prompt),
                           "cacheLength": len(prompt), "tokenIds": prompt, "numChunks": export["chunks"],
                           "totalBytes": str(kv_bytes), "modelId": info.model_id}
    assert export["messages"] == export["chunks"] + 1 and export["chunkBytes"] == kv_bytes
    assert export["chunks"] >= math.ceil(len(prompt) / 4)  # no chunk crosses one of the exporter's blocks

    imported = s["import"]
    assert {k: imported[k] for k in ("cacheId", "sequenceLength", "blockSize", "importedTokens", "replayed")} == \
        {"cacheId": "moved", "sequenceLength": len(prompt), "blockSize": 8, "importedTokens": len(prompt),
         "replayed": False}
    # Streamed through as it came: the same chunks as the export kept in the array.
    assert (imported["streamedChunks"], imported["streamedBytes"]) == (export["chunks"], kv_bytes)
    assert int(imported["timing"]["totalNs"]) > 0
    assert s["replay"]["replayed"] is True
    assert (s["replay"]["cacheId"], s["replay"]["sequenceLength"]) == ("moved", len(prompt))

    decode = s["decode"]
    assert decode["equal"] is True and decode["source"]["sha256"] == decode["target"]["sha256"]
    for side, block_size in (("source", 4), ("target", 8)):
        assert decode[side]["sequenceLength"] == len(prompt) + 1 and decode[side]["blockSize"] == block_size
        assert decode[side]["vocab"] == info.vocab_size
    # The same step through the Python client: the same logits, bit for bit.
    with ExecutorClient(source.address, timeout=30) as ex:
        py = ex.prefill(PrefillInput(prompt, logits_policy=LogitsPolicy.argmax()))
        assert py.logits.token_id == prefill["tokenId"] == decode["tokenId"]
        step = ex.decode(DecodeInput(py.logits.token_id, py.kv_cache, logits_policy=LogitsPolicy.full()))
        ex.release_cache(step.kv_cache)
    row = np.ascontiguousarray(step.logits.logits, dtype="<f4")
    assert hashlib.sha256(row.tobytes()).hexdigest() == decode["source"]["sha256"]
    assert int(row.argmax()) == decode["source"]["argmax"]

    listed = s["list"]
    assert [{k: c[k] for k in ("cacheId", "sequenceLength", "numBlocks", "loraAdapter")} for c in listed["caches"]] \
        == [{"cacheId": "moved", "sequenceLength": len(prompt) + 1, "numBlocks": 2, "loraAdapter": ""}]
    assert 0 <= listed["caches"][0]["idleSeconds"] < 60
    assert listed["named"] == ["moved"]  # a name that is not live is left out

    stale = s["stale-release"]
    assert (stale["error"], stale["code"], stale["reason"]) == ("FAILED_PRECONDITION", 9, "STALE_CACHE_HANDLE")
    assert stale["expectedLength"] == len(prompt) and stale["metadata"]["cache_length"] == str(len(prompt) + 1)
    assert s["release"] == {"step": "release", "expectedLength": len(prompt) + 1, "released": True,
                            "freedBlocks": math.ceil((len(prompt) + 1) / 4)}
    for name in ("export-missing", "import-missing"):
        assert (s[name]["error"], s[name]["code"], s[name]["reason"]) == ("NOT_FOUND", 5, "CACHE_NOT_FOUND"), s[name]
    exhausted = s["import-exhausted"]
    assert (exhausted["error"], exhausted["reason"]) == ("RESOURCE_EXHAUSTED", "KV_CACHE_EXHAUSTED"), exhausted
    assert s["cleanup"] == {"step": "cleanup", "released": True, "targetCaches": 0, "sourceCaches": 0}

    # Every pool is free again: the cancelled export let go of its snapshot too.
    for server in (source, target, small):
        with ExecutorClient(server.address, timeout=30) as ex:
            deadline = time.monotonic() + 10
            while (pool := ex.status().kv_pool).free_blocks != pool.total_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.free_blocks == pool.total_blocks and pool.active_caches == 0, pool
            assert ex.list_caches() == []
