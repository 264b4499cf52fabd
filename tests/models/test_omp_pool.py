"""One OpenMP pool per process (executors/omp_pool.py): the executor's worker keeps the only
one, whatever else ran torch's parallel ops (the load, the weights' digest, an adapter's
reading). A second pool throttles libgomp's spinning, which cost a batch_prefill ~10 %."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from executors.omp_pool import SPIN_COUNT, in_passing_thread

ROOT = Path(__file__).resolve().parents[2]

# A fresh process counts its threads that Python did not start (libgomp's pool threads, and
# whatever torch starts at import) at each point, and prints the counts as JSON.
SCRIPT = textwrap.dedent("""
    import asyncio, json, os, sys, threading, time
    import torch
    torch.set_num_threads(2)  # a pool of one more thread per thread that runs parallel ops
    from executors import omp_pool
    from executors.llm import LlmExecutor, LlmExecutorConfig
    from executors.descriptions import LoraSource
    from executors.types import DecodeInput, PrefillInput

    def native(settle_to=None):
        # A thread that ended is gone from Python before its OS thread and its pool have exited.
        for _ in range(100):
            count = len(os.listdir("/proc/self/task")) - threading.active_count()
            if count == settle_to or settle_to is None:
                break
            time.sleep(0.05)
        return count

    def parallel_op():  # big enough for torch to share it out over its threads
        return float(torch.ones(4_000_000).mul_(2).sum())

    model_dir, adapter_dir = sys.argv[1:3]
    from executors.cpu_kernels import cpu_kernels
    counts = {"runtime": omp_pool.openmp_runtime(), "kernels": cpu_kernels() is not None, "base": native()}
    omp_pool.in_passing_thread(parallel_op)
    counts["passing"] = native(settle_to=counts["base"])

    async def serve():
        ex = LlmExecutor(LlmExecutorConfig(model_dir=model_dir, block_size=16, num_blocks=4096, max_loras=2))
        counts["built"] = native(settle_to=counts["base"])
        await ex.warmup()
        await ex.kv_fingerprint()  # the weights' digest, off the worker
        files = {p: open(os.path.join(adapter_dir, p), "rb").read()
                 for p in ("adapter_config.json", "adapter_model.safetensors")}
        await ex.load_lora_adapter("tuned", LoraSource(config_json=files["adapter_config.json"],
                                                       safetensors=files["adapter_model.safetensors"]))
        out = await ex.prefill(PrefillInput(input_ids=list(range(1, 200))))
        for _ in range(3):
            out = await ex.decode(DecodeInput(token_id=5, kv_cache=out.kv_cache))
        counts["served"] = native()
        parallel_op()  # the control: the main thread's own pool, beside the worker's
        counts["main"] = native()
        ex.worker.close()

    asyncio.run(serve())
    counts["closed"] = native(settle_to=counts["base"] + 1)  # the worker's pool went with it

    async def pinned():  # on a fresh loop's fresh thread (the first loop's was pinned for the digest)
        await omp_pool.off_worker(parallel_op)
        counts["off_worker"] = native()  # while that thread lives: a pool of its own would count

    asyncio.run(pinned())
    print(json.dumps(counts))
""")


def test_in_passing_thread_hands_back_the_result_or_the_exception():
    assert in_passing_thread(sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ZeroDivisionError):
        in_passing_thread(lambda: 1 / 0)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc")
def test_the_worker_keeps_the_only_openmp_pool(tmp_path):
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    # A tied embedding of 2048 x 64: unpacking its panels for the digest is a copy big enough
    # for torch to share out over its threads (the tiny models' 320 rows are not).
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=512, tie_word_embeddings=True)).eval()
    base.save_pretrained(tmp_path / "model")
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "saved")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model"), str(tmp_path / "saved")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    if not (counts["runtime"] or "").rsplit("/", 1)[-1].startswith("libgomp"):
        pytest.skip(f"the counts follow GNU libgomp's pools; this torch runs on {counts['runtime']}")
    if not counts["kernels"]:
        pytest.skip("the CPU kernels do not build here: a tiny model's steps may then start no pool at all")
    base = counts["base"]
    # A thread that ends takes its pool along.
    assert counts["passing"] == base, counts
    # The build (load, KV pool fill) left nothing; the worker's steps made the one pool, and
    # the digest and the adapter's reading added none.
    assert counts["built"] == base, counts
    assert counts["served"] == base + 1, counts
    # The count sees a pool where one is made: the main thread's parallel op makes a second.
    assert counts["main"] == base + 2, counts
    # A thread pinned by off_worker makes none.
    assert counts["off_worker"] == counts["closed"] == base + 1, counts


def test_spin_briefly_sets_the_spin_before_torch_loads_and_keeps_an_operators_choice():
    script = textwrap.dedent("""
        import json, os, sys
        from executors import omp_pool
        first = omp_pool.spin_briefly()  # no torch yet: the setting will be read
        set_to = os.environ["GOMP_SPINCOUNT"]
        import torch
        print(json.dumps([first, set_to, omp_pool.spin_briefly()]))
    """)

    def run(env: dict) -> list:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    clean = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert run(clean) == [True, str(SPIN_COUNT), False]  # too late once torch is in
    assert run({**clean, "GOMP_SPINCOUNT": "250"}) == [True, "250", False]
