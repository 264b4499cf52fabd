"""`python -m service`: serve an executor over gRPC (see --help)."""

import asyncio
import logging

from service.config import parse_args
from service.server import serve


def main() -> None:
    config = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
