"""`python -m service`: serve an executor over gRPC (see --help)."""

import asyncio
import sys

from service.config import parse_args


def main() -> None:
    config = parse_args()
    # Importing torch and grpc takes seconds on a cold start: say so before it starts.
    what = "the paged reference executor" if config.executor == "paged" else config.model
    print(f"modelexec: starting: importing torch and grpc, then loading {what}", flush=True)
    from executors.models.config import UnsupportedModel
    from service.auth import CredentialsError
    from service.logs import configure_logging
    from service.server import serve

    configure_logging(config.log_format)
    try:
        world = _tensor_parallel_world(config)
        if world is not None and world.spec.rank != 0:  # ranks 1..N-1 run rank 0's steps; only rank 0 serves
            from executors.parallel.rank import serve_rank
            from service.server import llm_config

            sys.exit(serve_rank(llm_config(config), world.group))
        asyncio.run(serve(config, world))
    except UnsupportedModel as e:
        # A model the decoder cannot serve is a start-up failure with a message, not a traceback.
        sys.exit(f"modelexec: cannot serve {config.model}: {e}")
    except CredentialsError as e:
        sys.exit(f"modelexec: {e}")
    except ValueError as e:  # a tensor-parallel world that does not fit the flags or the devices
        sys.exit(f"modelexec: {e}")


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
