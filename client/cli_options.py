"""What every command of `python -m client` shares: the credentials of the clients it builds
(`--token`, default $MODELEXEC_TOKEN; `--ca`, `--cert`, `--key`), the program's name, and a
quiet end when stdout's reader went away."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

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
