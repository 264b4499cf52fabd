"""The table lines of the GPU parts (bench/gpu.py, bench/offline.py), each target with its verdict."""

from __future__ import annotations

import json
from pathlib import Path


class RowSink(list):
    """The part's rows; with a path, each row is also appended to that JSON-lines file as it is
    made, so a stage stopped at its time limit (bench/gpu_check.py) keeps what it measured."""

    def __init__(self, path: str | None = None):
        super().__init__()
        self.path = Path(path) if path else None

    def append(self, row: dict) -> None:
        super().append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict]:
    """The rows a RowSink wrote (none when the file is missing; a cut-off last line is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def _verdict(ok: bool) -> str:
    return "met" if ok else "SHORT"


def table_lines(rows: list[dict]) -> list[str]:
    """The part's rows for the suite's table, each target with its verdict."""
    out = ["(e) GPU: Qwen3-0.6B-shaped random model, bfloat16"]
    for x in rows:
        what = x.get("what")
        if "skipped" in x:
            out.append(f"    skipped: {x['skipped']}")
        elif what == "ceilings":
            out.append(f"    {x['device']}: copy {x['copy_gb_s']:.0f} GB/s (read + write), "
                       f"bf16 matmul {x['matmul_tflops']:.0f} TFLOP/s")
        elif what == "decode":
            target = ""
            if x["batch"] == 1 and x["attention"] == "triton + graphs":
                target = f"  [target <= 1.5x the floor: {_verdict(x['x_floor'] <= 1.5)}]"
            gpu = f", graph {x['graph_device_ms']:.3f} ms on the device" if x.get("graph_device_ms") else ""
            out.append(f"    decode {x['attention']:24s} batch {x['batch']:2d}: {x['step_ms']:7.3f} ms/step "
                       f"{x['tok_s']:8.0f} tok/s {x['bandwidth_gb_s']:5.0f} GB/s, {x['x_floor']:.2f}x the floor"
                       f"{gpu}{target}")
        elif what == "decode pipelined":
            gpu = f", graph {x['graph_device_ms']:.3f} ms on the device" if x.get("graph_device_ms") else ""
            out.append(f"    decode {x['attention']:24s} batch {x['batch']:2d}, two fed steps in flight: "
                       f"{x['step_ms']:7.3f} ms/step ({x['one_at_a_time_ms'] / x['step_ms']:.2f}x one at a time)"
                       f"{gpu}")
        elif what == "batch_prefill":
            out.append(f"    batch_prefill {x['prompts']}x{x['prompt_len']} {x['batched_ms']:.1f} ms "
                       f"({x['batched_tflops']:.0f} TFLOP/s) vs {x['prompts']} prefills {x['serial_ms']:.1f} ms: "
                       f"{x['ratio']:.1f}x  [target >= 15x: "
                       f"{_verdict(x['ratio'] >= 15)}]")
        elif what == "grpc":
            out.append(f"    gRPC {x['rpc']:13s} batch {x['batch']} ARGMAX: {x['grpc_ms']:.3f} ms vs in-process "
                       f"{x['inproc_ms']:.3f} ms (+{100 * x['over_inproc']:.1f}%)  [target <= 5%: "
                       f"{_verdict(x['over_inproc'] <= 0.05)}]")
        elif what == "vs transformers":
            if "error" in x:
                out.append(f"    vs transformers ({x['mode']}) batch {x['batch']}: {x['error']}")
                continue
            need = 5 if x["batch"] == 1 else 3
            out.append(f"    vs transformers ({x['mode']:8s}) batch {x['batch']:2d}: {x['ours_step_ms']:.3f} vs "
                       f"{x['hf_step_ms']:.3f} ms/step: {x['ratio']:.1f}x  [target >= {need}x: "
                       f"{_verdict(x['ratio'] >= need)}]")
        elif what == "few_row_matmuls":
            out.append("    few-row matmuls chosen at capture: "
                       + (", ".join(f"{k} {v}" for k, v in x["chosen"].items()) or "none"))
        elif what == "offline throughput":
            out.append(f"    offline {x['requests']} requests, {x['engine']}: {x['generated']} tokens in "
                       f"{x['elapsed_s']:.1f} s = {x['tok_s']:.0f} tok/s")
        else:
            out.append(f"    {json.dumps(x)}")
    return out
