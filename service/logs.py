"""Log output: text lines on stderr, or (`--log-format json`) every record as one JSON
object per line. "modelexec.rpc" is the logger of the one line per RPC
(service/observability.py): failed calls in text logs, every call in JSON logs.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

rpc_log = logging.getLogger("modelexec.rpc")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, and an RPC's fields when present."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
        }
        rpc = getattr(record, "rpc", None)
        if isinstance(rpc, dict):
            out.update(rpc)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Log to stderr, as text lines or as one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Every RPC in JSON logs; only the failed ones in text logs.
    rpc_log.setLevel(logging.DEBUG if log_format == "json" else logging.NOTSET)
