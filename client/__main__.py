"""`python -m client [--target HOST:PORT] COMMAND`: inspect a running executor.

One function per subcommand, registered in `_COMMANDS`, so adding one is two lines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from google.protobuf import json_format
from google.protobuf.message import Message

from client.blocking import ExecutorClient
from client.errors import ExecutorError
from client.limits import DEFAULT_TIMEOUT_S

Command = Callable[[ExecutorClient, argparse.Namespace], Message | None]


def _to_json(message: Message | None) -> str:
    """JSON with proto field names and zero values shown, since zeros are informative here."""
    if message is None:
        return "null"
    return json_format.MessageToJson(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def cmd_info(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return ex.server_info()


def cmd_capabilities(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return ex.capabilities()


def cmd_status(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return ex.status()


def cmd_cache_metrics(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return ex.cache_metrics()


def cmd_lora_metrics(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return ex.lora_metrics()


def cmd_health(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return ex.health()


_COMMANDS: dict[str, tuple[Command, str]] = {
    "info": (cmd_info, "model and server description (GetInfo)"),
    "capabilities": (cmd_capabilities, "executor capabilities and limits"),
    "status": (cmd_status, "state, counters and KV pool usage"),
    "cache-metrics": (cmd_cache_metrics, "KV reuse and decode batching metrics (null when none)"),
    "lora-metrics": (cmd_lora_metrics, "LoRA adapter metrics (null when none)"),
    "health": (cmd_health, "grpc.health.v1 status of the executor service"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="host:port or unix:///path")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-call deadline, seconds")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (func, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text).set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with ExecutorClient(args.target, timeout=args.timeout) as ex:
            print(_to_json(args.func(ex, args)))
    except ExecutorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
