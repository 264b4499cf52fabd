"""The suite's report: the table printed at the end of a run, and its PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.common import RESULTS, ROOT
from bench.lora import LORA_RANK


# -- report ----------------------------------------------------------------------------------
def table(results: dict) -> str:
    out = []
    r = results["results"]
    if "prefill" in r:
        out.append("(a) batch_prefill vs serial prefill")
        for x in r["prefill"]:
            out.append(f"    {x['dtype']:8s} {x['prompts']}x{x['prompt_len']}: one call {x['batched_s']:.2f} s "
                       f"({x['batched_tok_s']:.0f} tok/s), serial {x['serial_s']:.2f} s: {x['ratio']:.2f}x "
                       f"[target >= 2x: {'met' if x['ratio'] >= 2 else 'SHORT'}]")
    if "decode" in r:
        out.append("(b) decode throughput (gRPC unix socket, ARGMAX, context ~128)")
        out.append(f"    {'dtype':8s} {'rpc':13s} {'batch':>5s} {'ms/step':>9s} {'tok/s':>8s} {'GB/s':>6s}")
        for x in r["decode"]:
            out.append(f"    {x['dtype']:8s} {x['rpc']:13s} {x['batch']:5d} {x['step_ms']:9.1f} {x['tok_s']:8.1f} "
                       f"{x['bandwidth_gb_s']:6.1f}")
    if "grpc" in r:
        out.append("(c) gRPC overhead on one decode step (fp32, medians; client in the server's process or its own)")
        out.append(f"    {'transport':9s} {'client':10s} {'rpc':13s} {'batch':>5s} {'policy':10s} {'in-proc ms':>10s} "
                   f"{'+ms':>7s} {'ratio':>7s}")
        for x in r["grpc"]:
            if "echo_ms" in x:
                continue
            out.append(f"    {x['transport']:9s} {x.get('client', 'in-process'):10s} {x.get('rpc', 'BatchDecode'):13s} "
                       f"{x['batch']:5d} {x['policy']:10s} {x['inproc_ms']:10.2f} {x['overhead_ms']:7.3f} "
                       f"{100 * x['overhead_ratio']:6.1f}%")
        for x in r["grpc"]:
            if "echo_ms" in x:
                met = "met" if x["over_echo_ms"] <= 0.3 else "SHORT"
                out.append(f"    batch 1 over a bare grpc.aio {x['rpc']} ({x['request_bytes']} / {x['response_bytes']} "
                           f"bytes, {x['echo_ms']:.3f} ms): ours {x['ours_overhead_ms']:.3f} ms, "
                           f"+{x['over_echo_ms']:.3f} ms  [target <= 0.3 ms: {met}]")
                if "echo_after_step_ms" in x:
                    out.append(f"      the same echo answering after a {x['step_ms']:.1f} ms wait on a worker thread "
                               f"{x['echo_after_step_ms']:.3f} ms: ours {x['over_echo_after_step_ms']:+.3f} ms")
    if "hf" in r:
        out.append("(d) ours vs transformers (same weights, in-process)")
        for x in r["hf"]:
            if "skipped" in x:
                out.append(f"    skipped: {x['skipped']}")
                continue
            out.append(f"    {x['dtype']:8s} batch {x['batch']:2d}: prefill {x['ours_prefill_tok_s']:7.0f} vs "
                       f"{x['hf_prefill_tok_s']:7.0f} tok/s ({x['prefill_ratio']:.2f}x); decode "
                       f"{x['ours_decode_tok_s']:6.1f} vs {x['hf_decode_tok_s']:6.1f} tok/s ({x['decode_ratio']:.2f}x)")
    if "prefix" in r:
        out.append("(f) prefix caching: prefill of a shared system prompt + question (in-process)")
        for x in r["prefix"]:
            out.append(f"    {x['dtype']:8s} {x['system_len']}+{x['question_len']} tokens: cold {x['cold_ms']:.1f} ms, "
                       f"prefix hit {x['hit_ms']:.1f} ms ({x['reused_tokens']} tokens reused): {x['speedup']:.1f}x")
    if "lora" in r:
        out.append(f"(g) multi-LoRA: decode step, rank {LORA_RANK} on all seven projections (in-process, context ~128)")
        for x in r["lora"]:
            out.append(f"    {x['dtype']:8s} batch {x['batch']:2d} {x['mix']:18s} {x['step_ms']:8.1f} ms "
                       f"({x['vs_base']:.2f}x base)")
    if "gpu" in r or "offline" in r:
        from bench.gpu_report import table_lines

        out.extend(table_lines(r.get("gpu", []) + r.get("offline", [])))
    if "peers" in r:
        from bench.peers import table_lines as peer_lines

        out.extend(peer_lines(r["peers"]))
    if "transfer" in r:
        from bench.transfer import table_lines as transfer_lines

        out.extend(transfer_lines(r["transfer"]))
    if "tp" in r:
        from bench.tensor_parallel import table_lines as tp_lines

        out.extend(tp_lines(r["tp"]))
    return "\n".join(out)


def plots(results: dict, out: Path, latest: bool) -> list[str]:
    """PNG plots beside `out` (<its stem>-<name>.png) and, for a run into bench/results
    (`latest`), copies under bench/results/plots/, which the README shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no plots: pip install -r bench/requirements.txt)", flush=True)
        return []
    written = []
    plot_dir = RESULTS / "plots"
    if latest:
        plot_dir.mkdir(parents=True, exist_ok=True)
    r = results["results"]
    title = f"{results['machine']['cpu']} ({results['machine']['cores']} cores), SmolLM2-135M"

    def save(fig, name):
        for path in [out.with_name(f"{out.stem}-{name}.png")] + ([plot_dir / f"{name}.png"] if latest else []):
            fig.savefig(path, dpi=110, bbox_inches="tight")
            written.append(str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT)
                           else str(path))
        plt.close(fig)

    if r.get("decode"):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for dtype in sorted({x["dtype"] for x in r["decode"]}):
            for rpc, style in (("BatchDecode", "-o"), ("UnifiedDecode", "--s")):
                xs = [x for x in r["decode"] if x["dtype"] == dtype and x["rpc"] == rpc]
                ax1.plot([x["batch"] for x in xs], [x["tok_s"] for x in xs], style, label=f"{rpc} {dtype}")
                ax2.plot([x["batch"] for x in xs], [x["bandwidth_gb_s"] for x in xs], style, label=f"{rpc} {dtype}")
        for ax, label in ((ax1, "decode tokens/s"), (ax2, "achieved GB/s (weights + KV per step)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=8)
        fig.suptitle(f"Decode throughput (context ~128, gRPC unix socket) - {title}", fontsize=9)
        save(fig, "decode")
    if r.get("grpc"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, b in zip(axes, (1, 32)):
            xs = [x for x in r["grpc"] if x["batch"] == b and x.get("rpc", "BatchDecode") == "BatchDecode"]
            names = list(dict.fromkeys(x["policy"] for x in xs))
            series = [(t, c) for t in ("tcp", "unix") for c in ("in-process", "process")
                      if any(x["transport"] == t and x.get("client", "in-process") == c for x in xs)]
            width = 0.8 / len(series)
            for k, (transport, client) in enumerate(series):
                vals = [next(x["overhead_ms"] for x in xs if x["policy"] == n and x["transport"] == transport
                             and x.get("client", "in-process") == client) for n in names]
                ax.bar(np.arange(len(names)) + k * width, vals, width,
                       label=f"{transport}, client {'in the server process' if client == 'in-process' else 'apart'}")
            ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
            ax.set_ylabel("gRPC overhead per step (ms)")
            ax.set_title(f"batch {b}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
        fig.suptitle(f"Decode step over gRPC minus in-process - {title}", fontsize=9)
        save(fig, "grpc")
    hf = [x for x in r.get("hf", []) if "skipped" not in x]
    if hf:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, what in zip(axes, ("prefill", "decode")):
            labels = [f"{x['dtype']}\nbatch {x['batch']}" for x in hf]
            ax.bar(np.arange(len(hf)) - 0.2, [x[f"ours_{what}_tok_s"] for x in hf], 0.4, label="modelexec")
            ax.bar(np.arange(len(hf)) + 0.2, [x[f"hf_{what}_tok_s"] for x in hf], 0.4, label="transformers")
            ax.set_xticks(np.arange(len(hf)), labels)
            ax.set_ylabel(f"{what} tokens/s")
            ax.grid(alpha=0.3, axis="y")
            ax.legend()
        fig.suptitle(f"Ours vs transformers (same weights) - {title}", fontsize=9)
        save(fig, "vs_transformers")
    if r.get("prefill"):
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = r["prefill"]
        ax.bar(np.arange(len(xs)) - 0.2, [x["batched_s"] for x in xs], 0.4, label="one batch_prefill call")
        ax.bar(np.arange(len(xs)) + 0.2, [x["serial_s"] for x in xs], 0.4, label="prefill calls in a row")
        ax.set_xticks(np.arange(len(xs)), [f"{x['dtype']}\n{x['ratio']:.2f}x" for x in xs])
        ax.set_ylabel(f"seconds for {xs[0]['prompts']} x {xs[0]['prompt_len']} tokens")
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
        ax.set_title(title, fontsize=8)
        save(fig, "prefill")
    return written
