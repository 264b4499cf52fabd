"""`python -m bench.sampling`: the logits policies' own cost, outside the model.

Times `executors.logits.apply_policies` on seeded float32 logits rows of SmolLM2's
vocabulary (49152) for ARGMAX and SAMPLE (temperature 0.8 with top-p 0.95, or with
top-k 50, or with min-p 0.05), ARGMAX with the 5 most likely ids' log-probabilities, and
ARGMAX and SAMPLE with logits adjustments as a chat front end sends them (the penalties
over a 512-token prompt and 256 generated tokens, a bias on 20 ids; or an allow-list of
1000 ids), at batch 1 and 32; median of --rounds. Each case runs through torch's ops and,
where they build, the CPU kernels (argmax.c, sampling.c), which a float32 executor on a CPU
uses, in alternating rounds (before run 26 it timed torch's, and the rows one call per row
too). To compare with another version of the code, run the same command from a checkout of
it (`python -m` puts the working directory first on the path, ahead of PYTHONPATH).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from executors.adjustments import LogitsAdjustments
from executors.cpu_kernels import cpu_kernels
from executors.logits import apply_policies
from executors.types import LogitsKind, LogitsPolicy

VOCAB = 49152
_tokens = torch.randint(0, VOCAB, (768,), generator=torch.Generator().manual_seed(1)).tolist()
_generated = Counter(_tokens[512:])
_prompt_only = [t for t in dict.fromkeys(_tokens[:512]) if t not in _generated]
PENALTIES = LogitsAdjustments(
    penalized_token_ids=(*_generated, *_prompt_only),
    penalized_token_counts=(*_generated.values(), *[0] * len(_prompt_only)),
    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
    logit_bias=tuple((t, -5.0) for t in range(100, 2100, 100)),
)
ALLOWED = LogitsAdjustments(allowed_token_ids=tuple(range(0, VOCAB, VOCAB // 1000))[:1000])
POLICIES = {
    "ARGMAX": LogitsPolicy(kind=LogitsKind.ARGMAX),
    "SAMPLE t=0.8 top_p=0.95": LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_p=0.95, seed=1),
    "SAMPLE t=0.8 top_k=50": LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_k=50, seed=1),
    "SAMPLE t=0.8 min_p=0.05": LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, min_p=0.05, seed=1),
    "ARGMAX top_logprobs=5": LogitsPolicy(kind=LogitsKind.ARGMAX, top_logprobs=5),
    "ARGMAX + penalties": LogitsPolicy(kind=LogitsKind.ARGMAX, adjustments=PENALTIES),
    "ARGMAX + allow-list": LogitsPolicy(kind=LogitsKind.ARGMAX, adjustments=ALLOWED),
    "SAMPLE top_p + penalties": LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_p=0.95, seed=1,
                                             adjustments=PENALTIES),
    "SAMPLE top_p + allow-list": LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_p=0.95, seed=1,
                                              adjustments=ALLOWED),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(32, VOCAB, generator=gen) * 3  # logits spread like a small LM's
    kernels = cpu_kernels()
    ways = {"torch": None} if kernels is None else {"torch": None, "CPU kernels": kernels}
    if kernels is None:
        print("the CPU kernels do not build here: torch's ops only", flush=True)
    for name, policy in POLICIES.items():
        for batch in (1, 32):
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.rounds):  # the ways alternate, so a slow stretch of the machine hits both
                for way, with_kernels in ways.items():
                    started = time.perf_counter()
                    apply_policies(rows[:batch], [policy] * batch, list(range(batch)), kernels=with_kernels)
                    times[way].append(time.perf_counter() - started)
            figures = ", ".join(f"{way} {statistics.median(t) * 1e3:6.2f} ms" for way, t in times.items())
            print(f"{name:26s} batch {batch:2d}: {figures}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
