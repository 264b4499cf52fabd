"""`make gpu-check` (`python -m bench.gpu_check`): the whole GPU path checked in one command.

On a CUDA machine, in under 10 minutes:
1. the environment: GPU, driver, CUDA, Python, torch, Triton, transformers, grpcio, protobuf;
2. every CUDA test (CUDA_TESTS): the Triton kernels compiled for this device against SDPA,
   the triton executor paths and the decode CUDA graphs (capture, replay, padding rows)
   against the reference computation, the KV pool sized from device memory, and tests/gpu:
   real servers (`python -m service --device cuda`) for tiny Qwen3, Llama and Qwen2 models
   in float32 and bfloat16, every RPC through the real client against transformers in
   float32 on the CPU;
3. bench part (e) on the Qwen3-0.6B-shaped model in bfloat16 (bench/gpu.py, ~3 minutes), with
   `--offline` also the offline-throughput part (bench/offline.py, ~3 more), and with
   `--profile` where a decode step's time goes (bench/gpu_profile.py, ~1 more), and with
   `--gemv` the few-row Triton matmul against torch's (bench/gpu_gemv.py, ~1 more).

It writes one report, <out>/<date>-gpu-check-<gpu>.txt, and beside it the JSON of the
environment, every test's outcome and the bench rows. Each stage runs in a process of its
own under a time limit (`--budget-s` in all, of which each later stage keeps its share), so
a stage that hangs or crashes is reported and the next one still runs; test outcomes and
bench rows are written as they come, so a stopped stage keeps what it measured. The exit
status is 0 when every stage finished and every test passed.

A GPU machine without a package index gets requirements-gpu.txt as wheels: `make gpu-wheels`
where an index answers (for Python 3.12; GPU_PYTHON_VERSION=... for another) fills .whl
(git-ignored), then, there: `make gpu-check PIP_FLAGS="--no-index --find-links .whl"`.
Run 20 in bench/RESULTS.md used `ARGS="--out DIR --offline --budget-s 550 --bench-s 220
--offline-s 140"` on an H100 (486 s).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.gpu_report import read_rows, table_lines
from bench.outcome_log import PATH_VARIABLE

ROOT = Path(__file__).resolve().parent.parent
CUDA_TESTS = ["tests/models/test_triton_attention.py", "tests/models/test_triton_prologue.py",
              "tests/models/test_triton_glu.py", "tests/models/test_triton_paths.py",
              "tests/models/test_triton_gemv.py", "tests/models/test_few_row_matmuls.py", "tests/models/test_moe.py",
              "tests/test_kv_sizing.py", "tests/gpu"]
ENV_SCRIPT = r"""
import json, platform, subprocess
info = {"python": platform.python_version()}
for name in ("torch", "triton", "transformers", "peft", "grpc", "google.protobuf", "numpy"):
    try:
        module = __import__(name, fromlist=["__version__"])
        info[name] = getattr(module, "__version__", "?")
    except Exception as e:
        info[name] = f"missing ({type(e).__name__})"
import torch
info["torch_cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1))
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
except (OSError, subprocess.SubprocessError) as e:
    info["nvidia_smi"] = f"unavailable ({type(e).__name__})"
print(json.dumps(info))
"""


def run_stage(name: str, cmd: list[str], limit_s: float, log: Path) -> dict:
    """Run one stage in a process group of its own, its output teed to `log` and to our stdout;
    at the limit, or after it exits, the whole group goes (the servers a test started too)."""
    print(f"== {name}: {' '.join(cmd)} (limit {limit_s:.0f} s)", flush=True)
    started = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env=env, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                out.flush()
                sys.stdout.write(line)
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(10)
    seconds = time.perf_counter() - started
    tail = log.read_text(errors="replace").splitlines()[-40:]
    status = "timed out" if timed_out else ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
    print(f"== {name}: {status} in {seconds:.0f} s", flush=True)
    return {"stage": name, "status": status, "seconds": round(seconds, 1), "log": log.name, "tail": tail}


def report(results: dict) -> str:
    env = results["environment"]
    lines = [f"modelexec GPU check, {results['started']} ({results['seconds']:.0f} s)",
             f"command: {results['command']}", "", "environment:"]
    lines += [f"    {k}: {v}" for k, v in env.items()]
    lines += ["", "stages:"] + [f"    {s['stage']:8s} {s['status']:10s} {s['seconds']:6.0f} s  (log: {s['log']})"
                                for s in results["stages"]]
    for s in results["stages"]:
        if s["status"] != "ok" and s.get("tail"):
            lines += [f"    the end of the {s['stage']} log:"] + [f"        {line}" for line in s["tail"]]
    tests = results["tests"]
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    ran_tests = any(st["stage"] == "tests" for st in results["stages"])
    lines += ["", f"CUDA tests ({results.get('tests_run') or ', '.join(CUDA_TESTS)}): "
              + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or ("no results" if ran_tests else "not run"))]
    for t in tests:
        if t["outcome"] in ("failed", "error"):
            first = t["message"].splitlines()[0] if t["message"] else ""
            lines.append(f"    {t['outcome'].upper()} {t['test']}: {first[:300]}")
    budgets = [json.loads(t["bf16_budget"]) for t in tests if t.get("bf16_budget")]
    if budgets:
        lines.append("    bfloat16 logits against float32 transformers (max relative L2 per row):")
        for b in budgets:
            lines.append(f"        {b['family']:6s} ours {b['ours_max_rel']:.4f}, transformers' own bfloat16 "
                         f"{b['transformers_bf16_max_rel']:.4f}")
    slow = sorted(tests, key=lambda t: -t["seconds"])[:5]
    if slow:
        lines.append("    slowest: " + ", ".join(f"{t['test'].split('::')[-1]} {t['seconds']:.1f} s" for t in slow))
    bench = results.get("bench", {})
    if any(bench.values()):
        lines += [""] + table_lines(bench.get("gpu", []) + bench.get("offline", []))
    if results.get("profile"):
        lines += ["", "where a decode step's time goes (bench/gpu_profile.py): the -profile.txt beside this"]
    if results.get("gemv"):
        lines += ["", "the few-row Triton matmul against torch's (bench/gpu_gemv.py), device us a call:"]
        lines += [f"    {r['matmul']:8s} {r['n']:6d}x{r['k']:<5d} rows {r['rows']}: torch {r['torch_us']:7.2f} "
                  f"({r['torch_gb_s']:5.0f} GB/s), best triton {r['best']} {r['triton'][r['best']]['us']:7.2f}: "
                  f"{r['speedup']:.2f}x" for r in results["gemv"] if "best" in r]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the report (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=560, help="time for all stages together (default %(default)s)")
    p.add_argument("--bench-s", type=float, default=230,
                   help="of the budget, kept for bench part (e) (default %(default)s); the tests get the rest")
    p.add_argument("--offline", action="store_true", help="also the offline-throughput bench part")
    p.add_argument("--offline-s", type=float, default=150,
                   help="with --offline, kept for that part (default %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="also where a decode step's time goes (bench/gpu_profile.py), into <stem>-profile.txt")
    p.add_argument("--profile-s", type=float, default=90, help="with --profile, kept for it (default %(default)s)")
    p.add_argument("--gemv", action="store_true",
                   help="also the few-row Triton matmul against torch's (bench/gpu_gemv.py), into <stem>-gemv.json")
    p.add_argument("--gemv-s", type=float, default=60, help="with --gemv, kept for it (default %(default)s)")
    p.add_argument("--tests", default=None, metavar="PYTEST_ARGS",
                   help="pytest's arguments instead of every CUDA test (a rerun of some: 'FILE -k NAME')")
    p.add_argument("--skip-tests", action="store_true", help="the environment and the bench only")
    p.add_argument("--skip-bench", action="store_true", help="the environment and the tests only")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stamp = dt.datetime.now(dt.UTC)
    results: dict = {"command": "python -m bench.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "started": stamp.isoformat(timespec="seconds"), "stages": [], "tests": []}

    def left() -> float:
        return args.budget_s - (time.perf_counter() - started)

    env = subprocess.run([sys.executable, "-c", ENV_SCRIPT], check=False, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    results["environment"] = json.loads(env.stdout) if env.returncode == 0 else {"error": env.stderr[-2000:]}
    print(json.dumps(results["environment"], indent=1), flush=True)
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", str(results["environment"].get("gpu", "no-gpu"))).strip("-").lower()
    stem = f"{stamp.date().isoformat()}-gpu-check-{gpu}"
    if (out / f"{stem}.txt").exists():  # never overwrite an earlier run of the day
        stem = next(f"{stem}-{n}" for n in itertools.count(2) if not (out / f"{stem}-{n}.txt").exists())
    # Each stage's limit is what is left less what the later stages keep, so time one stage does
    # not use goes to the next, and a stage that hangs cannot starve the ones after it.
    parts = ([] if args.skip_bench else ["gpu"] + (["offline"] if args.offline else [])) + (
        ["profile"] if args.profile else []) + (["gemv"] if args.gemv else [])
    kept = {"gpu": args.bench_s, "offline": args.offline_s, "profile": args.profile_s, "gemv": args.gemv_s}
    tests = shlex.split(args.tests) if args.tests else CUDA_TESTS
    if not args.skip_tests:
        outcomes = out / f"{stem}-tests.jsonl"
        outcomes.unlink(missing_ok=True)
        os.environ[PATH_VARIABLE] = str(outcomes)  # bench/outcome_log.py writes each outcome there
        # The CUDA tests need no third-party pytest plugin, and a GPU image's own (timeout, cov,
        # benchmark, ...) were built for its pytest, not necessarily the one pinned here.
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        results["stages"].append(run_stage("tests", [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p",
                                                     "no:cacheprovider", "-p", "bench.outcome_log", *tests],
                                           max(left() - sum(kept[x] for x in parts), 60), out / f"{stem}-tests.log"))
        results["tests"] = read_rows(outcomes)  # there even when the stage was stopped
        results["tests_run"] = " ".join(tests)
        outcomes.unlink(missing_ok=True)
    results["bench"] = {}
    for i, part in enumerate(parts):
        limit = max(left() - sum(kept[x] for x in parts[i + 1:]), 60)
        if part == "profile":
            tables = out / f"{stem}-profile.txt"
            results["stages"].append(run_stage(part, [sys.executable, "-m", "bench.gpu_profile", "--out", str(tables)],
                                               limit, out / f"{stem}-profile.log"))
            results["profile"] = tables.read_text() if tables.is_file() else None
            continue
        if part == "gemv":
            rows_json = out / f"{stem}-gemv.json"
            results["stages"].append(run_stage(part, [sys.executable, "-m", "bench.gpu_gemv", "--out", str(rows_json)],
                                               limit, out / f"{stem}-gemv.log"))
            results["gemv"] = json.loads(rows_json.read_text()) if rows_json.is_file() else None
            continue
        rows_file = out / f"{stem}-{part}.jsonl"
        rows_file.unlink(missing_ok=True)
        results["stages"].append(run_stage(part, [sys.executable, "-m", "bench", "--parts", part, "--no-plots",
                                                  "--rows-jsonl", str(rows_file),
                                                  "--out", str(out / f"{stem}-{part}-suite.json")],
                                           limit, out / f"{stem}-{part}.log"))
        results["bench"][part] = read_rows(rows_file)
        rows_file.unlink(missing_ok=True)
        (out / f"{stem}-{part}-suite.json").unlink(missing_ok=True)
    results["seconds"] = time.perf_counter() - started
    text = report(results)
    (out / f"{stem}.txt").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + text + f"\nwrote {out / stem}.txt and .json", flush=True)
    failed = [t for t in results["tests"] if t["outcome"] in ("failed", "error")]
    stages_ok = all(s["status"] == "ok" for s in results["stages"])
    return 0 if stages_ok and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
