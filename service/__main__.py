"""`python -m service`: serve an executor over gRPC (see --help)."""

import asyncio
import logging
import sys

from executors.models.config import UnsupportedModel
from service.config import parse_args
from service.server import serve


def main() -> None:
    config = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except UnsupportedModel as e:
        # A model the decoder cannot serve is a start-up failure with a message, not a traceback.
        sys.exit(f"modelexec: cannot serve {config.model}: {e}")


if __name__ == "__main__":
    main()
