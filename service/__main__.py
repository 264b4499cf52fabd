"""`python -m service`: serve an executor over gRPC (see --help)."""

import asyncio
import contextlib
import os
import signal
import sys


def main() -> None:
    try:
        from service.config import parse_args

        code = _serve(parse_args())
    except KeyboardInterrupt:  # Ctrl-C before serving (imports, model load, warm-up): nothing to drain
        code = 128 + signal.SIGINT
    _exit(code)


def _serve(config) -> int:
    """Serve until stopped; the exit status. A start-up failure is one line on stderr."""
    # Importing torch and grpc takes seconds on a cold start: say so before it starts.
    what = "the paged reference executor" if config.executor == "paged" else config.model
    print(f"modelexec: starting: importing torch and grpc, then loading {what}", flush=True)
    from executors.omp_pool import spin_briefly

    spin_briefly()  # before torch loads its OpenMP runtime, which reads the setting then
    from executors.errors import ExecutorError
    from executors.models.config import UnsupportedModel
    from executors.parallel.comm import world_from_env
    from kvcache.errors import KvCacheError
    from service.auth import CredentialsError
    from service.listen import StartupError, check_address
    from service.logs import configure_logging
    from service.server import build_executor, serve

    configure_logging(config.log_format)
    try:
        if (spec := world_from_env()) is None or spec.rank == 0:  # the process that will serve
            check_address(config)  # a busy port said at once, not after the ranks and the model load
        world = _tensor_parallel_world(config)
        if world is not None and world.spec.rank != 0:  # ranks 1..N-1 run rank 0's steps; only rank 0 serves
            from executors.parallel.rank import serve_rank
            from service.server import llm_config

            sys.exit(serve_rank(llm_config(config), world.group))
        # Built before the event loop runs, so that Ctrl-C interrupts the load at once (inside
        # asyncio.run, the first one would only cancel the loop's task, after the load).
        executor = build_executor(config, world)
        asyncio.run(serve(config, world, executor))
    except UnsupportedModel as e:
        # A model the decoder cannot serve is a start-up failure with a message, not a traceback.
        return _fail(f"cannot serve {config.model}: {e}")
    except (StartupError, CredentialsError, ExecutorError, KvCacheError) as e:  # address, TLS, adapters, warm-up
        return _fail(str(e))
    except ValueError as e:  # a tensor-parallel world that does not fit the flags or the devices
        return _fail(str(e))
    return 0


def _fail(message: str) -> int:
    print(f"modelexec: {message}", file=sys.stderr, flush=True)
    return 1


def _exit(code: int) -> None:
    """Leave now, without waiting for the executor's worker thread.

    A call cut off when the grace ran out leaves its forward running on that (non-daemon)
    thread, where nothing can interrupt it: a normal exit joins the thread first, which kept
    a stopped server's process alive for a minute past a 1 s grace, and a Ctrl-C meanwhile
    ended it with a KeyboardInterrupt traceback. Nothing is left to do at this point: the
    server stopped (or never started) and every line was written; flush them and go."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing more to say
            stream.flush()
    os._exit(code)


def _tensor_parallel_world(config):
    """The torch.distributed world of this process (spawning it when asked), or None."""
    from executors.parallel.comm import world_from_env

    spec = world_from_env()
    if config.tensor_parallel_size == 1 and (spec is None or spec.world == 1):
        return None
    from executors.parallel.launch import start_world

    return start_world(config.tensor_parallel_size, config.device, config.tensor_parallel_timeout_s, sys.argv[1:])


if __name__ == "__main__":
    main()
