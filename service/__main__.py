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
    from service.observability import configure_logging
    from service.server import serve

    configure_logging(config.log_format)
    try:
        asyncio.run(serve(config))
    except UnsupportedModel as e:
        # A model the decoder cannot serve is a start-up failure with a message, not a traceback.
        sys.exit(f"modelexec: cannot serve {config.model}: {e}")
    except CredentialsError as e:
        sys.exit(f"modelexec: {e}")


if __name__ == "__main__":
    main()
