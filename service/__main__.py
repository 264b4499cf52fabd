"""`python -m service`: serve an executor over gRPC (see --help)."""

import asyncio
import sys

from executors.models.config import UnsupportedModel
from service.auth import CredentialsError
from service.config import parse_args
from service.observability import configure_logging
from service.server import serve


def main() -> None:
    config = parse_args()
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
