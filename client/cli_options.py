"""What the commands of `python -m client` share: the credentials of the clients it builds
(`--token`, default $MODELEXEC_TOKEN; `--ca`, `--cert`, `--key`), the program's name, a quiet
end when stdout's reader went away, and the argument types and tokenizer of `generate` and
`schedule` (a value out of its field's range is refused by argparse, naming the flag, before
any call)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .logits_policy import LogitsPolicy, Penalties

TOKEN_ENV = "MODELEXEC_TOKEN"  # as the TypeScript client's demo and move scripts read it


def program_name() -> str:
    """How this was started: `python -m client` (or `python -m modelexec_client`), or the
    installed script's name (`modelexec-client`)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not name or name in ("__main__.py", "-c") or name.endswith(".pyz"):
        return f"python -m {__package__ or 'client'}"
    return name


def _read_pem(args: argparse.Namespace, flag: str) -> bytes | None:
    path = getattr(args, flag)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--{flag} {path}: {e.strerror or e}") from None


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments (credentials, token) of every client the CLI builds."""
    options: dict[str, Any] = {}
    if args.ca is not None or args.cert is not None:
        from .security import tls_credentials

        options["credentials"] = tls_credentials(_read_pem(args, "ca"), _read_pem(args, "cert"),
                                                 _read_pem(args, "key"))
    if args.token:
        from .security import bearer_metadata

        try:
            bearer_metadata(args.token)
        except ValueError as e:
            raise ValueError(f"--token (or ${TOKEN_ENV}): {e}") from None
        options["token"] = args.token
    return options


def stdout_gone() -> int:
    """stdout's reader went away (`| head`): stop quietly, as Python's own tools do. Further
    writes, including the interpreter's flush at exit, go to /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # not a real file (captured, or closed already)
    return 1


MAX_SEED = 2**64 - 1  # LogitsPolicy's seed is a uint64


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be >= {low}, got {value}" if high is None else f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def temperature(text: str) -> float:
    """An argparse type: a sampling temperature, finite and >= 0 (0: greedy)."""
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0 (0 is greedy), got {text}")
    return value


def probability(text: str) -> float:
    """An argparse type: a nucleus mass, in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


seed = at_least(0, MAX_SEED)


def float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number in [low, high]."""
    def parse(text: str) -> float:
        value = _float(text)
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        return value

    parse.__name__ = "number"
    return parse


def positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


def add_tokenizer_argument(p: argparse.ArgumentParser) -> None:
    from .tokenizer import DEFAULT_TOKENIZER_DIR

    default = (f"default: the embedded model, {DEFAULT_TOKENIZER_DIR}"
               if (Path(DEFAULT_TOKENIZER_DIR) / "tokenizer.json").is_file() else
               "no default here: the embedded model is only in a checkout, after `make model`")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help=f"directory with the served model's tokenizer.json ({default})")


def load_tokenizer(directory: str | None) -> Any:
    """--tokenizer's TextTokenizer; without one, the embedded model's, if this is a checkout that has it."""
    from . import tokenizer

    if directory is None:
        directory = tokenizer.DEFAULT_TOKENIZER_DIR
        if not (Path(directory) / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer: pass --tokenizer DIR, the served model's directory with its "
                             f"tokenizer.json (the default, the embedded model at {directory}, is not there: it "
                             f"is only in a checkout, after `make model`)")
    return tokenizer.TextTokenizer(directory)


# -- the sampling flags generate and schedule share -------------------------------------------
SAMPLING_ONLY = ("top_k", "top_p", "min_p", "seed")  # flags that need --temperature > 0


def add_sampling_arguments(p: argparse.ArgumentParser, *, seed_help: str) -> None:
    """--temperature, --top-k, --top-p, --min-p, --seed and the three penalties."""
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0 is greedy (default %(default)s); above 0, sampled on the server")
    p.add_argument("--top-k", type=at_least(0, 2**32 - 1), default=None,
                   help="sampling: among the k most likely tokens; 0 keeps all (default)")
    p.add_argument("--top-p", type=probability, default=None, help="sampling: nucleus mass, in (0, 1]")
    p.add_argument("--min-p", type=float_in(0, 1), default=None,
                   help="sampling: keep tokens at least this share as probable as the most probable, in [0, 1]")
    p.add_argument("--seed", type=seed, default=None, help=seed_help)
    p.add_argument("--repetition-penalty", type=positive, default=None,
                   help="divide the positive logits (multiply the negative) of the prompt's and generated tokens "
                        "by this, > 0 (1: none)")
    p.add_argument("--presence-penalty", type=float_in(-2, 2), default=0.0,
                   help="subtract this from the logit of every token generated so far, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float_in(-2, 2), default=0.0,
                   help="subtract this times its count from the logit of every token generated so far, in [-2, 2]")
    p.add_argument("--min-tokens", type=at_least(0), default=0,
                   help="keep the end-of-sequence tokens out until this many new tokens came (at most --max-tokens)")


def check_sampling_arguments(args: argparse.Namespace) -> str | None:
    """A sampling flag that greedy decoding would ignore, or one out of range with another,
    named; None when there is none."""
    if args.min_tokens > args.max_tokens:
        return f"--min-tokens {args.min_tokens} is more than --max-tokens {args.max_tokens}"
    if args.temperature == 0:
        for flag in SAMPLING_ONLY:
            if getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} has no effect on greedy decoding: add --temperature > 0"
    return None


def sampling_policy(args: argparse.Namespace, seed: int | None) -> LogitsPolicy:
    """The policy the flags ask for, drawing with `seed`."""
    if args.temperature == 0:
        return LogitsPolicy.argmax()
    return LogitsPolicy.sample(args.temperature, top_k=args.top_k or 0, top_p=args.top_p, seed=seed,
                               min_p=args.min_p)


def sampling_penalties(args: argparse.Namespace) -> Penalties:
    return Penalties(args.repetition_penalty, args.presence_penalty, args.frequency_penalty)
