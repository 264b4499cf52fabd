"""The benchmark suite is not run here (it takes minutes); only that it starts and reports."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench import common, gpu, gpu_report, lora, report, suite


def test_help_lists_the_parts():
    done = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for part in suite.PARTS:
        assert part in done.stdout


def test_unknown_parts_are_refused():
    done = subprocess.run([sys.executable, "-m", "bench", "--parts", "nonsense"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "nonsense" in done.stderr


def test_a_bad_out_directory_or_dtype_is_refused_before_any_part_runs(tmp_path, capsys):
    import pytest

    for argv, fragment in ((["--out", str(tmp_path / "missing" / "x.json")], "does not exist"),
                           (["--dtypes", "float32,float23"], "float23 is not one of")):
        with pytest.raises(SystemExit) as refused:
            suite.main(["--parts", "gpu", "--no-plots", *argv])
        assert refused.value.code == 2 and fragment in capsys.readouterr().err


def test_the_table_reports_every_part_and_the_targets():
    results = {"results": {
        "prefill": [{"dtype": "float32", "prompts": 32, "prompt_len": 128, "batched_s": 1.0, "batched_tok_s": 4096.0,
                     "serial_s": 1.5, "ratio": 1.5}],
        "decode": [{"dtype": "float32", "rpc": "BatchDecode", "batch": 1, "step_ms": 40.0, "tok_s": 25.0,
                    "bandwidth_gb_s": 13.5}],
        "grpc": [{"transport": "unix", "batch": 1, "policy": "ARGMAX", "inproc_ms": 40.0, "overhead_ms": 1.0,
                  "overhead_ratio": 0.025}],
        "hf": [{"skipped": "transformers is not installed"}],
        "prefix": [{"dtype": "float32", "system_len": 1024, "question_len": 32, "reused_tokens": 1024,
                    "cold_ms": 900.0, "hit_ms": 60.0, "cold_tok_s": 1173.0, "speedup": 15.0}],
        "lora": [{"dtype": "float32", "batch": 8, "mix": "4 adapters + base", "rank": 16, "step_ms": 75.0,
                  "vs_base": 1.25}],
        "gpu": gpu.bench_gpu(SimpleNamespace(quick=True, device="cuda")) if not torch.cuda.is_available() else [],
    }}
    text = report.table(results)
    assert "1.50x [target >= 2x: SHORT]" in text and "BatchDecode" in text and "ARGMAX" in text
    assert "prefix hit 60.0 ms (1024 tokens reused): 15.0x" in text
    assert "batch  8 4 adapters + base      75.0 ms (1.25x base)" in text
    if not torch.cuda.is_available():
        assert "skipped: no GPU" in text


def test_the_lora_part_builds_adapters_the_executor_accepts(tmp_path):
    from executors.llm import LlmExecutor, LlmExecutorConfig
    from tests.models.tiny_models import build

    build("qwen3", tmp_path)
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path), num_blocks=8))
    try:
        adapter = ex.loras.read("bench", lora.random_lora_source(ex, seed=1))
        assert adapter.rank == lora.LORA_RANK and adapter.target_modules == tuple(sorted(lora.LORA_MODULES))
        assert len(adapter.weights) == 7 * ex.model_config.num_layers
    finally:
        ex.worker.close()


def test_the_gpu_parts_dry_run_on_a_cpu():
    """bench/gpu.py and bench/offline.py on a tiny model on the CPU (SDPA; a CUDA machine runs
    the real thing): every section runs and the table reports each target with its verdict."""
    args = SimpleNamespace(quick=True, device="cpu", shape="tiny")
    rows = gpu.bench_gpu(args)
    from bench.offline import bench_offline

    rows += bench_offline(args)
    kinds = {r["what"] for r in rows}
    assert kinds == {"ceilings", "decode", "decode pipelined", "batch_prefill", "grpc", "vs transformers",
                     "offline throughput"}, kinds
    # two fed steps in flight, at each batch, for the default path (in the dry run: SDPA)
    assert [r["batch"] for r in rows if r["what"] == "decode pipelined"] == [1, 4]
    # BatchDecode, UnifiedDecode, StepSession, and a StepSession keeping fed steps in flight
    assert [r["rpc"] for r in rows if r["what"] == "grpc"] == ["BatchDecode", "UnifiedDecode", "StepSession",
                                                              "StepSession pipelined"]
    offline = [r for r in rows if r["what"] == "offline throughput"]
    assert offline[0]["generated"] == offline[1]["generated"] > 0  # every request ran to its length on both
    text = "\n".join(gpu_report.table_lines(rows))
    assert "[target <= 1.5x the floor:" not in text  # that target is the graphed path's, which a CPU lacks
    assert "[target >= 15x:" in text and "[target <= 5%:" in text and "[target >= 5x:" in text


def test_the_peers_part_reports_each_target_or_how_to_install_it():
    from bench import peers

    skipped = "\n".join(peers.table_lines([{"skipped": "llama_cpp is not installed: pip install -r "
                                                          "bench/requirements-peers.txt"}]))
    assert "bench/requirements-peers.txt" in skipped
    rows = [
        {"what": "engine", "engine": "llama.cpp F32", "decode_ms_b1": 20.0, "prefill_ms": 270.0},
        {"what": "engine", "engine": "CTranslate2 fp32", "decode_ms_b1": 22.0, "tok_s_b32": 200.0, "prefill_ms": 200.0},
        {"what": "engine", "engine": "ours fp32 (gRPC, unix socket, ARGMAX)", "decode_ms_b1": 25.0,
         "decode_ms_b1_stream": 24.0, "tok_s_b32": 450.0, "prefill_ms": 190.0, "fp32_peak_gflops": 180.0,
         "batched_prefill_gflops": 120.0},
    ]
    text = "\n".join(peers.table_lines(rows))
    assert "1.25x llama.cpp F32's step  [target <= 1.3x: met]" in text
    assert "2.25x CTranslate2's tokens/s  [target >= 2x: met]" in text
    assert "0.95x CTranslate2's time  [target <= 1x: met]" in text
    assert "120 GFLOP/s, 67 % of the 180 GFLOP/s FMA peak  [target >= 75 %: SHORT]" in text
    with_sgemm = [{**r, "sgemm_gflops": 150.0} if "fp32_peak_gflops" in r else r for r in rows]
    assert ("67 % of the 180 GFLOP/s FMA peak; a torch 2048-cube sgemm: 150  [target >= 75 %: SHORT]"
            in "\n".join(peers.table_lines(with_sgemm)))
    # Rounds: each ratio between rows of one round, the median of those reported with them.
    slower = [{**r, "round": 1, "decode_ms_b1": r["decode_ms_b1"] * 1.5} for r in rows]  # ours 1.25x again
    ct2_dip = [{**r, "round": 2} for r in rows]
    ct2_dip[1]["tok_s_b32"] = 150.0  # ours 3.00x in that round
    text = "\n".join(peers.table_lines(rows + slower + ct2_dip))
    assert "medians of 3 rounds" in text
    assert "decode batch 1: 1.25x llama.cpp F32's step (rounds: 1.25, 1.25, 1.25)  [target <= 1.3x: met]" in text
    assert "decode batch 32: 2.25x CTranslate2's tokens/s (rounds: 2.25, 2.25, 3.00)  [target >= 2x: met]" in text
    # With int8 weights beside llama.cpp's Q8_0: their own ratio.
    quantized = rows + [
        {"what": "engine", "engine": "llama.cpp Q8_0", "decode_ms_b1": 8.0, "prefill_ms": 260.0},
        {"what": "engine", "engine": "ours int8 (gRPC, unix socket, ARGMAX)", "decode_ms_b1": 14.0,
         "decode_ms_b1_stream": 13.5, "tok_s_b32": 520.0, "prefill_ms": 150.0, "fp32_peak_gflops": 180.0,
         "batched_prefill_gflops": 130.0},
    ]
    text = "\n".join(peers.table_lines(quantized))
    assert "decode batch 1, int8 weights: 1.75x llama.cpp Q8_0's step  [target <= 1.3x: SHORT]" in text
    assert "decode batch 1, int8 weights, on a StepSession stream: 1.69x  [target <= 1.3x: SHORT]" in text
    assert "1.25x llama.cpp F32's step" in text  # the float32 ratios still compare ours fp32


def test_prefill_flops_count_the_lm_head_once_a_prompt():
    from types import SimpleNamespace

    cfg = SimpleNamespace(vocab_size=100, hidden_size=8, tie_word_embeddings=True, head_dim=4, num_heads=2,
                          num_layers=3)
    ex = SimpleNamespace(model=SimpleNamespace(config=cfg), num_parameters=800 + 5000)  # a tied embedding + layers
    # 2 prompts of 3 tokens: layers for 6 tokens, the head for 2, 2 x 6 causal pairs of 4 x 4 x 2 x 3
    assert common.prefill_flops(ex, 2, 3) == 2 * 5000 * 6 + 2 * 800 * 2 + 4 * 4 * 2 * 3 * 12
    untied_cfg = SimpleNamespace(**{**vars(cfg), "tie_word_embeddings": False})
    untied = SimpleNamespace(model=SimpleNamespace(config=untied_cfg), num_parameters=1600 + 5000)
    assert common.prefill_flops(untied, 2, 3) == common.prefill_flops(ex, 2, 3)


def test_the_grpc_floor_is_a_bare_echo_of_the_same_sizes():
    from bench.echo import echo_round_trips

    loop = common.Loop()
    try:
        trips = echo_round_trips(loop, 45, 77, rounds=20)
    finally:
        loop.close()
    assert set(trips) == {"unary", "stream"} and all(0 < t < 1 for t in trips.values())


def test_the_transfer_part_moves_checked_caches_between_two_server_processes():
    """bench/transfer.py against two paged reference servers of 64 tokens (no 8k prefill here) on
    unix sockets (the real run adds TCP): two chunk sizes, the decode-step check of the moved
    cache, the CPU each process spent, and the table."""
    from bench import transfer

    args = ["--executor", "paged", "--block-size", "16", "--num-blocks", "64", "--no-prefix-caching",
            "--cache-ttl-seconds", "0"]
    chunks = (256, 1 << 20)  # one layer of a position or so per chunk, and a whole block per chunk
    rows = transfer.run((64,), ("unix",), args=args, rounds=1, prefills=lambda n: 1, chunks=chunks)
    assert [r["max_chunk_bytes"] for r in rows] == list(chunks)
    for r in rows:
        # positions x layers x (K, V) x KV heads x head dim x fp32
        assert r["tokens"] == 64 and r["bytes"] == 64 * 2 * 2 * 4 * 8 * 4
        assert r["move_s"] > 0 and r["prefill_s"] > 0 and r["memcpy_gb_s"] > 0 and r["import_only_s"] > 0
        assert r["cpu_source_s"] >= 0 and r["cpu_target_s"] >= 0
        assert r["check"]["argmax_source"] == r["check"]["argmax_moved"]
    assert rows[0]["chunks_planned"] > rows[1]["chunks_planned"] == 4  # the 4 blocks of 16 positions
    text = "\n".join(transfer.table_lines(rows))
    assert "prefill/move" in text and "ImportKv from memory" in text and text.count("same KV, ") == 2


def test_the_quantization_bench_measures_int8_against_float32(monkeypatch):
    """bench.quantization's two halves on the embedded model, on a small workload: int8
    agrees with float32 on nearly every token, and its weights take about a quarter."""
    import pytest
    from tokenizers import Tokenizer

    from bench import quantization
    from executors.cpu_kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("int8 weights run on the CPU kernels, which cannot be built here")
    monkeypatch.setattr(quantization, "PASSAGES", quantization.PASSAGES[:2])
    monkeypatch.setattr(quantization, "QUESTIONS", quantization.QUESTIONS[:1])
    monkeypatch.setattr(quantization, "GREEDY_TOKENS", 6)
    monkeypatch.setattr(quantization, "BATCHES", (1, 2))
    monkeypatch.setattr(quantization, "DECODE_STEPS", 2)
    executors = {"float32": common.executor("float32", num_blocks=64),
                 "int8": common.executor("float32", num_blocks=64, quantization="int8")}
    try:
        tok = Tokenizer.from_file(str(common.MODEL_DIR / "tokenizer.json"))
        acc = quantization.accuracy(executors["float32"], executors["int8"], tok)
        assert acc["positions"] > 40 and acc["top1_agreement"] > 0.9 and 0 < acc["mean_kl_nats"] < 0.05, acc
        assert len(acc["greedy_tokens_alike"]) == 1 and acc["greedy_tokens"] == 6
        fast = quantization.speed(executors, rounds=1)
        assert fast["int8"]["weight_bytes"] < 0.3 * fast["float32"]["weight_bytes"]
        for row in fast.values():
            assert row["decode_ms_b1"] > 0 and row["tok_s_b2"] > 0 and row["prefill_ms"] > 0
    finally:
        for ex in executors.values():
            ex.worker.close()


def test_the_softcap_bench_times_both_sides(capsys):
    """bench.softcap on a tiny model: one line a case, both sides in the one-call step where
    the CPU kernels build."""
    from bench import softcap
    from executors.cpu_kernels import cpu_kernels

    assert softcap.main(["--batches", "1,2", "--contexts", "12", "--rounds", "1", "--hidden", "128",
                         "--layers", "2", "--vocab", "300"]) == 0
    out = capsys.readouterr().out
    built = cpu_kernels() is not None
    assert f"one-call CPU decode step: capped {built}, uncapped {built}" in out
    assert out.count("context    12, batch") == 2 and out.count("context    12, prefill") == 1
    assert "capped" in out and "uncapped" in out


def test_the_gpt_oss_bench_times_the_sinks_and_the_dequantization(capsys):
    """bench.gpt_oss at tiny sizes: a line a kernel case with both sides, the dequantization's."""
    from bench import gpt_oss
    from executors.cpu_kernels import cpu_kernels

    assert gpt_oss.main(["--contexts", "32", "--batches", "1,2", "--prompts", "24", "--rounds", "1", "--repeat", "1",
                         "--experts", "2", "--hidden", "64", "--intermediate", "32", "--layers", "3",
                         "--dequant-rounds", "1"]) == 0
    out = capsys.readouterr().out
    if cpu_kernels() is not None:
        assert out.count("decode, context    32, batch") == 2 and out.count("prefill, prompt    24") == 1
        assert out.count(" us, none ") == 3
    assert "dequant [2, 64, 64]" in out and "dequant [2, 64, 32]" in out and "3 layers" in out


def test_the_one_call_bench_times_both_paths(capsys):
    """bench.one_call on tiny models: a line per family and batch, each with both times."""
    from bench import one_call
    from executors.cpu_kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the CPU kernels do not build here: there is no one-call step to time")
    assert one_call.main(["--families", "gemma2,olmo2,cohere,starcoder2", "--batches", "1,3", "--context", "9",
                          "--rounds", "1", "--hidden", "256", "--layers", "2", "--vocab", "300"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "one call" in line]
    assert len(lines) == 8 and all("op by op" in line and "GB/s" in line for line in lines)
    assert [line.split()[0] for line in lines] == [f for f in ("gemma2", "olmo2", "cohere", "starcoder2") for _ in "ab"]


@pytest.mark.parametrize("architecture, quantization", [("mixtral", "none"), ("granitemoe", "int8")])
def test_the_moe_bench_times_both_models(architecture, quantization, capsys):
    """bench.moe at tiny sizes: both models built (Granite's stacked experts, int8 where asked
    and the kernels build), a line a batch with both times."""
    from bench import moe
    from executors.cpu_kernels import cpu_kernels

    if quantization == "int8" and cpu_kernels() is None:
        pytest.skip("int8 weights run on the CPU kernels, which cannot be built here")
    assert moe.main(["--batches", "1,2", "--rounds", "1", "--hidden", "256", "--layers", "2", "--vocab", "300",
                     "--expert-size", "64", "--architecture", architecture, "--quantization", quantization]) == 0
    out = capsys.readouterr().out
    assert f"style='{'granite' if architecture == 'granitemoe' else 'mixtral'}'" in out
    assert out.count("batch  1: dense") == 1 and out.count("batch  2: dense") == 1


def test_the_mla_bench_gives_the_cache_the_kernel_and_both_sides_steps(capsys):
    """bench.mla at tiny sizes: the cache lines, a kernel line a context, and a decode line a
    context and batch with both sides' steps and ours alone."""
    pytest.importorskip("transformers")
    from bench import mla
    from executors.cpu_kernels import cpu_kernels

    assert mla.main(["--contexts", "24", "--batches", "1,2", "--rounds", "1", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "cache, DeepSeek-V2-Lite" in out and "(71.1x ours)" in out
    assert out.count("kernel, context    24") == (1 if cpu_kernels() is not None else 0)
    assert out.count("decode, context    24, batch") == 2 and out.count("ours alone") == 2


def test_the_handles_bench_steps_both_forms_at_each_size(capsys, tmp_path):
    """bench.handles at tiny sizes: a line a call and size, and rows whose compact responses
    are the smaller, by the block ids they leave out."""
    pytest.importorskip("transformers")
    import json

    from bench import handles

    out_file = tmp_path / "handles.json"
    assert handles.main(["--ids", "4,64", "--batch", "2", "--rounds", "1", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert out.count("UnifiedDecode batch  2") == 2 and out.count("StepSession   batch  2") == 2
    rows = [r for r in json.loads(out_file.read_text())["rows"] if r["call"] == "UnifiedDecode"]
    assert [r["block_ids_per_handle"] for r in rows] == [4, 64]
    small, large = (r["full_response_bytes"] - r["compact_response_bytes"] for r in rows)
    assert 0 < small < large and large >= 2 * 64  # two handles' ids, at least a byte each
