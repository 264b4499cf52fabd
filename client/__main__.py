"""`python -m client [--target HOST:PORT] COMMAND`: inspect a running executor, or generate text.

One function per subcommand, registered in `_COMMANDS`, so adding one is two lines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from google.protobuf import json_format
from google.protobuf.message import Message

from ._proto import executor_pb2 as pb
from .blocking import ExecutorClient
from .errors import ExecutorError
from .limits import DEFAULT_TIMEOUT_S

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


def cmd_lora_list(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    # Printed as the RPC's response shape ({"adapters": [...]}): one JSON object like the rest.
    return pb.ListLoraAdaptersResponse(adapters=ex.list_lora_adapters())


def cmd_lora_load(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    if args.path is not None:
        return ex.load_lora_adapter(args.name, args.path)
    return ex.upload_lora_adapter(args.name, args.upload)


def _lora_load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the name requests give in metadata ferrum_lora_adapter")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--path", help="a PEFT adapter directory on the server, relative to its --lora-dir")
    source.add_argument("--upload", metavar="DIR",
                        help="a local PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")


def cmd_lora_unload(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return ex.unload_lora_adapter(args.name)


def _lora_unload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the adapter to unload")


def cmd_generate(ex: ExecutorClient, args: argparse.Namespace) -> None:
    """Stream a completion of --prompt (or a chat reply with --chat) to stdout."""
    from .generate import generate_text
    from .tokenizer import TextTokenizer
    from .types import LogitsPolicy

    tok = TextTokenizer(args.tokenizer)
    text = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = tok.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    policy = (LogitsPolicy.argmax() if args.temperature == 0 else
              LogitsPolicy.sample(args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed))
    stop = set() if args.ignore_eos else tok.eos_ids
    if not args.chat:
        print(args.prompt, end="", flush=True)
    for piece in generate_text(ex, tok, tok.encode(text), max_tokens=args.max_tokens, policy=policy, stop_ids=stop):
        print(piece, end="", flush=True)
    print()


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    from .tokenizer import DEFAULT_TOKENIZER_DIR

    p.add_argument("--prompt", required=True, help="text to complete (or the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 keeps all")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER_DIR),
                   help="directory with the served model's tokenizer.json (default: the embedded model)")


def cmd_schedule(ex: ExecutorClient, args: argparse.Namespace) -> None:
    """Run --prompts-file through the continuous-batching scheduler on --targets (client/scheduler.py),
    or disaggregated on --prefill-targets and --decode-targets (client/disaggregated.py)."""
    from .schedule_cli import run_schedule_command

    run_schedule_command(args)


def _schedule_arguments(p: argparse.ArgumentParser) -> None:
    from .schedule_cli import add_schedule_arguments

    add_schedule_arguments(p)


def cmd_list_caches(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return pb.ListCachesResponse(caches=ex.list_caches())


def cmd_drain(ex: ExecutorClient, args: argparse.Namespace) -> None:
    """Move every cache on --target to --to, then shut --target down (client/transfer.py)."""
    from .transfer import run_drain_command

    ex.close()  # the drain runs on asyncio clients of its own
    if not run_drain_command(args):
        raise ValueError("some caches could not be moved; the source was left running")


def _drain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", required=True, metavar="TARGETS",
                   help="comma-separated executors to move the caches to (host:port or unix:///path)")
    p.add_argument("--keep-running", action="store_true", help="do not shut the source down afterwards")
    p.add_argument("--grace-seconds", type=float, default=0.0, help="the source's shutdown grace period")


_COMMANDS: dict[str, tuple[Command, str]] = {
    "info": (cmd_info, "model and server description (GetInfo)"),
    "capabilities": (cmd_capabilities, "executor capabilities and limits"),
    "status": (cmd_status, "state, counters and KV pool usage"),
    "cache-metrics": (cmd_cache_metrics, "KV reuse and decode batching metrics (null when none)"),
    "lora-metrics": (cmd_lora_metrics, "LoRA adapter metrics (null when none)"),
    "health": (cmd_health, "grpc.health.v1 status of the executor service"),
    "lora-list": (cmd_lora_list, "the LoRA adapters loaded"),
    "lora-load": (cmd_lora_load, "load a LoRA adapter from a server directory (--path) or a local one (--upload)"),
    "lora-unload": (cmd_lora_unload, "unload a LoRA adapter (refused while caches are bound to it)"),
    "generate": (cmd_generate, "stream generated text from a prompt through the server"),
    "schedule": (cmd_schedule, "run a file of prompts through the continuous-batching scheduler"),
    "list-caches": (cmd_list_caches, "the caller's live KV caches (ListCaches)"),
    "drain": (cmd_drain, "move every cache of --target to the executors of --to, then shut --target down"),
}
_EXTRA_ARGUMENTS = {"generate": _generate_arguments, "schedule": _schedule_arguments, "drain": _drain_arguments,
                    "lora-load": _lora_load_arguments, "lora-unload": _lora_unload_arguments}


def build_parser() -> argparse.ArgumentParser:
    # `python -m client` in the checkout, `python -m modelexec_client` (or `modelexec-client`) installed.
    prog = "python -m client" if __package__ == "client" else "modelexec-client"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="host:port or unix:///path")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-call deadline, seconds")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (func, help_text) in _COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        command.set_defaults(func=func)
        if name in _EXTRA_ARGUMENTS:
            _EXTRA_ARGUMENTS[name](command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with ExecutorClient(args.target, timeout=args.timeout) as ex:
            result = args.func(ex, args)
            if args.command not in ("generate", "schedule", "drain"):
                print(_to_json(result))
    except (ExecutorError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
