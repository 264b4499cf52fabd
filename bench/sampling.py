"""`python -m bench.sampling`: the logits policies' own cost, outside the model.

Times `executors.logits.apply_policies` on seeded float32 logits rows of SmolLM2's
vocabulary (49152) for ARGMAX and SAMPLE (temperature 0.8 with top-p 0.95, or with
top-k 50), at batch 1 and 32; median of --rounds. At batch 32 it also times the rows one
call per row, as the executor applied them (item by item) before it ran one call per step.
To compare with another version of the code, run the same command with PYTHONPATH pointing
at a checkout of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from executors.logits import apply_policies
from executors.types import LogitsKind, LogitsPolicy

VOCAB = 49152
POLICIES = {
    "ARGMAX": LogitsPolicy(kind=LogitsKind.ARGMAX),
    "SAMPLE t=0.8 top_p=0.95": LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_p=0.95, seed=1),
    "SAMPLE t=0.8 top_k=50": LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_k=50, seed=1),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(32, VOCAB, generator=gen) * 3  # logits spread like a small LM's
    for name, policy in POLICIES.items():
        for batch in (1, 32):
            times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                apply_policies(rows[:batch], [policy] * batch, list(range(batch)))
                times.append(time.perf_counter() - started)
            print(f"{name:24s} batch {batch:2d}: {statistics.median(times) * 1e3:8.2f} ms", flush=True)
        per_row = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for r in range(32):
                apply_policies(rows[r:r + 1], [policy], [r])
            per_row.append(time.perf_counter() - started)
        print(f"{name:24s} batch 32, one call per row: {statistics.median(per_row) * 1e3:8.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
