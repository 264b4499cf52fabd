"""`make gpu-check` without a GPU: what can be checked of it on a CPU.

tests/gpu/ skips without CUDA; here one of its six servers runs on the CPU
(`--service-device cpu`), so the test code itself is exercised on every CI run. The
check's report is built from a run's results (the outcome lines of bench/outcome_log.py, the
bench's rows) the way a GPU run builds it, and the check's stages run end to end (on a CPU the
bench part reports no GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_report import read_rows
from bench.outcome_log import PATH_VARIABLE

REPO = Path(__file__).resolve().parent.parent


def test_the_service_checks_run_on_a_cpu_server(tmp_path):
    log = tmp_path / "outcomes.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.outcome_log",
                           "tests/gpu", "--service-device", "cpu", "-k", "qwen3-bfloat16"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, PATH_VARIABLE: str(log)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcomes = read_rows(log)
    assert len(outcomes) == 10 and all(t["outcome"] == "passed" for t in outcomes), outcomes
    (budget,) = [json.loads(t["bf16_budget"]) for t in outcomes if t.get("bf16_budget")]
    assert budget["family"] == "qwen3" and budget["ours_max_rel"] <= 3e-2


def test_the_report_names_failures_budgets_and_targets():
    results = {
        "command": "python -m bench.gpu_check", "started": "2026-11-23T00:00:00+00:00", "seconds": 300.0,
        "environment": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0"},
        "stages": [{"stage": "tests", "status": "ok", "seconds": 120, "log": "t.log", "tail": []},
                   {"stage": "bench", "status": "timed out", "seconds": 180, "log": "b.log", "tail": ["last words"]}],
        "tests": [
            {"test": "tests.gpu.test_cuda_service::test_x[qwen3-float32]", "outcome": "failed", "seconds": 1.0,
             "message": "AssertionError: logits differ\nmore"},
            {"test": "tests.gpu.test_cuda_service::test_report_bf16_error_budget[llama-bfloat16]",
             "outcome": "passed", "seconds": 2.0,
             "bf16_budget": json.dumps({"family": "llama", "ours_max_rel": 0.008, "transformers_bf16_max_rel": 0.009})},
        ],
        "bench": {"gpu": [
            {"what": "ceilings", "device": "H100", "copy_gb_s": 3000.0, "matmul_tflops": 790.0},
            {"what": "decode", "attention": "triton + graphs", "batch": 1, "context": 129, "step_ms": 0.9,
             "graph_device_ms": 0.7, "tok_s": 1111.0, "bytes_per_step": 1.2e9, "bandwidth_gb_s": 1333.0,
             "floor_ms": 0.4, "x_floor": 2.25},
            {"what": "batch_prefill", "prompts": 32, "prompt_len": 128, "batched_ms": 10.0, "serial_ms": 200.0,
             "per_prefill_ms": 6.25, "ratio": 20.0, "batched_tflops": 500.0, "matmul_tflops": 790.0},
        ]},
    }
    text = gpu_check.report(results)
    assert "FAILED tests.gpu.test_cuda_service::test_x[qwen3-float32]: AssertionError: logits differ" in text
    assert "llama  ours 0.0080, transformers' own bfloat16 0.0090" in text
    assert "bench    timed out" in text and "last words" in text
    assert "2.25x the floor" in text and "[target <= 1.5x the floor: SHORT]" in text
    assert "20.0x  [target >= 15x: met]" in text


def test_the_check_runs_its_stages_and_keeps_what_a_stopped_stage_made(tmp_path):
    """The whole check on a CPU, tests left out: the environment, bench part (e) in a stage of its
    own (which finds no GPU), the report and its JSON."""
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--skip-tests", "--profile", "--gemv", "--out",
                           str(tmp_path), "--budget-s", "260", "--bench-s", "100", "--profile-s", "60",
                           "--gemv-s", "60"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    (report,) = [p for p in tmp_path.glob("*-gpu-check-*.txt") if not p.name.endswith("-profile.txt")]
    text = report.read_text()
    assert "gpu      ok" in text and "profile  ok" in text and "gemv     ok" in text, text
    assert "skipped: no GPU" in text, text
    results = json.loads(report.with_suffix(".json").read_text())
    assert results["bench"]["gpu"] == [{"skipped": "no GPU"}]
    assert results["environment"]["cuda_available"] is False and results["profile"] == "skipped: no GPU\n"
    assert sorted(p.name.removeprefix(report.stem) for p in tmp_path.iterdir()) == [
        "-gemv.log", "-gpu.log", "-profile.log", "-profile.txt", ".json", ".txt"]
    assert done.returncode == 0, done.stdout[-2000:]
    # A second run that day gets a name of its own.
    again = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--skip-tests", "--out", str(tmp_path),
                            "--budget-s", "100", "--bench-s", "60"], check=False, cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and (tmp_path / f"{report.stem}-2.txt").is_file()


def test_the_profile_runs_on_a_cpu(tmp_path):
    """bench/gpu_profile.py's host and operator tables, on a tiny model on the CPU (a dry run)."""
    out = tmp_path / "profile.txt"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_profile", "--device", "cpu", "--shape", "tiny",
                           "--steps", "5", "--out", str(out)], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for section in ("-- host, batch 1, 5 steps", "-- host, batch 4", "-- gRPC server, batch 4, 1 steps per RPC",
                    "-- device, batch 1, 3 eager steps", "-- device, batch 4"):
        assert section in text, text[:2000]
    assert "run_step" in text  # the executor's own step shows in the host profile


def test_rows_reach_the_file_as_they_are_made(tmp_path):
    from bench.gpu_report import RowSink

    rows = RowSink(str(tmp_path / "rows.jsonl"))
    rows.append({"what": "ceilings", "copy_gb_s": 1.0})
    assert read_rows(tmp_path / "rows.jsonl") == [{"what": "ceilings", "copy_gb_s": 1.0}]
    with (tmp_path / "rows.jsonl").open("a") as f:
        f.write('{"what": "dec')  # a stage killed mid-write
    rows.append({"what": "decode"})
    assert read_rows(tmp_path / "rows.jsonl") == [{"what": "ceilings", "copy_gb_s": 1.0}]
    assert list(rows) == [{"what": "ceilings", "copy_gb_s": 1.0}, {"what": "decode"}]


def test_the_gemv_bench_runs_on_a_cpu(tmp_path):
    """bench/gpu_gemv.py on tiny shapes in Triton's interpreter (a dry run: the kernel's answers
    are checked, the times are not worth reading)."""
    pytest.importorskip("triton")
    out = tmp_path / "gemv.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_gemv", "--device", "cpu", "--out", str(out)],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["matmul"] for r in rows} == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all(r["triton"][key]["rel_err"] < 1e-5 for r in rows for key in ("16x32/4", "8x32/4 split 3"))


def test_the_gpu_venv_sees_the_packages_of_a_python_that_is_itself_a_venv(tmp_path):
    """`make gpu-check`'s environment (bench/gpu_venv.py) made by this test's python, itself a
    virtual environment here as on the GPU image: torch and grpc come from it, and a package
    installed into the new environment would win (its own site-packages come first)."""
    target = tmp_path / "venv-gpu"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_venv", str(target)], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    python = target / "bin" / "python"
    code = ("import os, sys, sysconfig, torch, grpc; machine = os.path.dirname(os.path.dirname(torch.__file__)); "
            "print(machine, sys.path.index(sysconfig.get_path('purelib')), sys.path.index(machine))")
    probe = subprocess.run([str(python), "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    machine, own_index, machine_index = probe.stdout.split()
    assert not machine.startswith(str(target))  # the making python's torch, not a copy
    assert int(own_index) < int(machine_index)  # what pip installs into the new environment wins
    again = subprocess.run([sys.executable, "-m", "bench.gpu_venv", str(target)], check=False, cwd=REPO,
                           capture_output=True, text=True, timeout=120)  # idempotent: `make gpu-check` reruns it
    assert again.returncode == 0, again.stderr[-2000:]
