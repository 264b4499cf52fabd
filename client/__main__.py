"""`python -m client [--target HOST:PORT] COMMAND`: inspect a running executor, or generate text.

One function per subcommand, registered in `_COMMANDS`, so adding one is two lines. A command
returns the message to print as JSON, or (generate, schedule, drain: they print their own)
its exit status. `--token` (default: $MODELEXEC_TOKEN), `--ca`, `--cert` and `--key` reach
every client a command builds.

Exit status: 0; 1 on a failed call, a failed request of `schedule`, a cache `drain` could not
move or a source it could not shut down, `health` other than SERVING, or a closed stdout; 2 on
bad arguments (argparse); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence

from google.protobuf import json_format
from google.protobuf.message import Message

from ._proto import executor_pb2 as pb
from .blocking import ExecutorClient
from .cli_options import TOKEN_ENV, client_options, program_name, stdout_gone
from .errors import ExecutorError
from .limits import DEFAULT_TIMEOUT_S

Command = Callable[[ExecutorClient, argparse.Namespace], Message | int | None]

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


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
    return ex.health()  # main() exits 1 unless it is SERVING


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
    """Stream a completion of --prompt (or a chat reply with --chat) to stdout. The prompt is
    printed once the prefill succeeded; a line left open is ended before an error (or Ctrl-C)."""
    from .cli_options import load_tokenizer, sampling_penalties, sampling_policy
    from .generate import generate_text

    tok = load_tokenizer(args.tokenizer)
    text = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = tok.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    stop = set() if args.ignore_eos else tok.eos_ids
    pieces = generate_text(ex, tok, tok.encode(text), max_tokens=args.max_tokens,
                           policy=sampling_policy(args, args.seed), stop_ids=stop, penalties=sampling_penalties(args),
                           min_tokens=args.min_tokens)
    wrote = False

    def show(text: str) -> None:
        nonlocal wrote
        print(text, end="", flush=True)
        wrote = wrote or bool(text)

    try:
        first = next(pieces, None)  # runs the prefill: nothing is printed before it succeeded
        if not args.chat:
            show(args.prompt)
        if first is not None:
            show(first)
            for piece in pieces:
                show(piece)
        print(flush=True)
    except BaseException:
        # Its cache released now, before anything else is printed; a failed release is not the
        # error to show (the one that stopped the generation is).
        with contextlib.suppress(ExecutorError):
            pieces.close()
        if wrote:
            try:
                print(flush=True)  # the error starts on a line of its own
            except OSError:
                pass
        raise


def _check_generate(args: argparse.Namespace) -> str | None:
    from .cli_options import check_sampling_arguments

    if (refused := check_sampling_arguments(args)) is not None:
        return refused
    if args.system is not None and not args.chat:
        return "--system is the system message of --chat: add --chat"
    return None


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    from .cli_options import add_sampling_arguments, add_tokenizer_argument, at_least

    p.add_argument("--prompt", required=True, help="text to complete (or the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-tokens", type=at_least(1), default=64, help="most new tokens (default %(default)s)")
    add_sampling_arguments(p, seed_help="sampling: seed for a reproducible draw")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    add_tokenizer_argument(p)


def cmd_schedule(ex: ExecutorClient, args: argparse.Namespace) -> int:
    """Run --prompts-file through the continuous-batching scheduler on --targets (client/scheduler.py),
    or disaggregated on --prefill-targets and --decode-targets (client/disaggregated.py).
    Exit status 1 when any request failed."""
    from .schedule_cli import run_schedule_command

    ex.close()  # the scheduler runs on asyncio clients of its own
    return 1 if run_schedule_command(args, **client_options(args)) else 0


def _check_schedule(args: argparse.Namespace) -> str | None:
    from .schedule_cli import check_schedule_arguments

    return check_schedule_arguments(args)


def _schedule_arguments(p: argparse.ArgumentParser) -> None:
    from .schedule_cli import add_schedule_arguments

    add_schedule_arguments(p)


def cmd_list_caches(ex: ExecutorClient, args: argparse.Namespace) -> Message | None:
    return pb.ListCachesResponse(caches=ex.list_caches())


def cmd_drain(ex: ExecutorClient, args: argparse.Namespace) -> int:
    """Move every cache on --target to --to, then shut --target down (client/drain.py).
    Exit status 1 when a cache could not be moved or the source refused to shut down (the
    failures are printed on stderr)."""
    from .drain import run_drain_command

    ex.close()  # the drain runs on asyncio clients of its own
    return 0 if run_drain_command(args, **client_options(args)) else 1


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
# Checks across flags, after parsing: a message makes the command's parser exit 2 with it.
_CHECKS: dict[str, Callable[[argparse.Namespace], str | None]] = {
    "generate": _check_generate, "schedule": _check_schedule}
_PRINTS_ITS_OWN = ("generate", "schedule", "drain")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    # `python -m client` in the checkout, `python -m modelexec_client` or `modelexec-client` installed.
    prog = prog or program_name()
    parser = argparse.ArgumentParser(
        prog=prog, description=f"{prog} [--target HOST:PORT] COMMAND: inspect a running executor, generate "
                               "text, run a file of prompts through the reference scheduler, or drain its caches.")
    parser.add_argument("--target", default="localhost:50051", help="host:port or unix:///path")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-call deadline, seconds")
    auth = parser.add_argument_group("credentials (for every client a command builds)")
    auth.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                      help=f"bearer token sent with every call (default: ${TOKEN_ENV}, when set)")
    auth.add_argument("--ca", metavar="PEM", default=None,
                      help="TLS: the CA certificate that verifies the server (implies TLS)")
    auth.add_argument("--cert", metavar="PEM", default=None,
                      help="mutual TLS: the client's certificate (with --key; implies TLS, with the system's "
                           "roots unless --ca)")
    auth.add_argument("--key", metavar="PEM", default=None, help="mutual TLS: the client's private key")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}  # type: ignore[attr-defined]
    for name, (func, help_text) in _COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(func=func)
        if name in _EXTRA_ARGUMENTS:
            _EXTRA_ARGUMENTS[name](command)
        parser.commands[name] = command  # type: ignore[attr-defined]
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.cert is None) != (args.key is None):
        parser.error("--cert and --key go together: give both (mutual TLS) or neither")
    if (check := _CHECKS.get(args.command)) is not None and (problem := check(args)):
        parser.commands[args.command].error(problem)  # type: ignore[attr-defined]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(_parse(argv))
    except KeyboardInterrupt:
        return INTERRUPTED  # the command's clean-up (its caches' release) ran as the exception unwound
    except BrokenPipeError:
        return stdout_gone()


def _run(args: argparse.Namespace) -> int:
    try:
        with ExecutorClient(args.target, timeout=args.timeout, **client_options(args)) as ex:
            result = args.func(ex, args)
            if args.command in _PRINTS_ITS_OWN:
                return int(result or 0)
            print(_to_json(result))
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
            if args.command == "health" and result.status != result.SERVING:
                return 1
    except BrokenPipeError:
        raise
    except ImportError as e:
        print(f"error: {e} (generate and schedule need the client's [cli] extra: tokenizers, jinja2)",
              file=sys.stderr)
        return 1
    except (ExecutorError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
