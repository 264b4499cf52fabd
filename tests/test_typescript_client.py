"""The TypeScript client (client/typescript): generated from protos/ at test time (buf +
ts-proto), compiled with tsc, and its demo run against a real server.

Its npm packages come from the committed package-lock.json (`make install-test` runs
`npm ci`); the generated code is not checked in, so it cannot go stale. The build runs in
a temporary copy of the package (sharing its node_modules), so that test runs side by
side never write into the working tree or into each other's build.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from client import ExecutorClient, LogitsPolicy, PrefillInput

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
    assert (package / "dist" / "demo.js").exists()
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
    assert list(s) == ["info", "prefill", "decode", "release", "status"], out.stdout

    vocab = s["info"]["vocabSize"]
    assert vocab == 256 and s["info"]["modelId"]
    prefill, decode = s["prefill"], s["decode"]
    assert prefill["cacheId"] and decode["cacheId"] == prefill["cacheId"]
    assert (prefill["sequenceLength"], decode["sequenceLength"]) == (3, 4)
    assert prefill["blockIds"] and prefill["blockSize"] == 4
    for step in (prefill, decode):
        assert 0 <= step["tokenId"] < vocab
        assert step["logprob"] <= 0 and math.isfinite(step["logprob"])
        # uint64 timings arrive as bigint, printed as decimal strings (protobuf JSON style).
        assert int(step["timing"]["totalNs"]) >= int(step["timing"]["executorNs"]) > 0
    assert s["release"] == {"step": "release", "cacheId": prefill["cacheId"], "released": True,
                            "freedBlocks": len(decode["blockIds"])}
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


def test_demo_reports_a_refused_call(built: Path, make_server) -> None:
    server = make_server()
    out = run_demo(built, server.address, "--prompt", "1,999")  # 999 is outside the vocabulary (256)
    assert out.returncode == 1, out.stdout + out.stderr
    error = json.loads([line for line in out.stderr.splitlines() if line.startswith("{")][-1])
    assert error["error"] == "INVALID_ARGUMENT" and error["code"] == 3
    assert "info" in steps(out.stdout) and "prefill" not in steps(out.stdout)
    with ExecutorClient(server.address, timeout=30) as ex:
        assert ex.status().kv_pool.active_caches == 0
