"""ServeConfig: every server setting in one dataclass, validated once."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
EXECUTORS = ("llm", "paged")
# Where the set-up (`make model`) converts the embedded SmolLM2-135M-Instruct.
DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class ServeConfig:
    # Where to listen. A unix socket replaces TCP when set.
    host: str = "127.0.0.1"
    port: int = 50051
    unix_socket: str | None = None
    # What to host: a real model (llm) or the weight-free paged reference executor.
    executor: str = "llm"
    model: str = DEFAULT_MODEL_DIR
    dtype: str = "auto"
    device: str = "cpu"
    num_blocks: int = 1024
    block_size: int = 16
    # Limits, shown by GetCapabilities. Messages are capped on both ends: gRPC's default
    # of 4 MiB is below one 256-sequence step of full logits.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_batch_size: int = 64
    max_tokens_per_request: int = 65536
    max_concurrent_rpcs: int | None = None
    # Lifecycle.
    warmup_on_start: bool = True
    allow_shutdown: bool = False
    grace_seconds: float = 5.0
    reflection: bool = True

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("num_blocks", "block_size", "max_batch_size", "max_tokens_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1024 <= self.max_message_bytes <= 2**31 - 1:
            raise ValueError("max_message_bytes must be in [1024, 2**31 - 1] (protobuf caps messages at 2 GiB)")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError("max_concurrent_rpcs must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.grace_seconds < 0:
            raise ValueError("grace_seconds must be >= 0")

    @property
    def address(self) -> str:
        """The address gRPC binds: unix:PATH, or host:port."""
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"


def parse_args(argv: Sequence[str] | None = None) -> ServeConfig:
    defaults = ServeConfig()
    p = argparse.ArgumentParser(prog="python -m service", description="Serve a model executor over gRPC.")
    p.add_argument("--host", default=defaults.host, help="TCP host to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=defaults.port, help="TCP port; 0 picks a free one (default %(default)s)")
    p.add_argument("--unix-socket", default=None, help="listen on this unix socket path instead of TCP")
    p.add_argument("--executor", choices=EXECUTORS, default=defaults.executor,
                   help="llm: a Hugging Face model directory; paged: the weight-free reference (default %(default)s)")
    p.add_argument("--model", default=defaults.model,
                   help="model directory for --executor llm (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=defaults.dtype,
                   help="weights and KV dtype; auto is float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", default=defaults.device, help="cpu or cuda[:N]")
    p.add_argument("--num-blocks", type=int, default=defaults.num_blocks, help="KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV block")
    p.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes,
                   help="largest gRPC message sent or received (default 256 MiB)")
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size, help="most items per batch call")
    p.add_argument("--max-tokens-per-request", type=int, default=defaults.max_tokens_per_request,
                   help="most tokens in one request, over all its items")
    p.add_argument("--max-concurrent-rpcs", type=int, default=None,
                   help="refuse RPCs beyond this many in flight with RESOURCE_EXHAUSTED")
    p.add_argument("--no-warmup", dest="warmup_on_start", action="store_false",
                   help="do not warm up at start; health stays NOT_SERVING until a Warmup call")
    p.add_argument("--allow-shutdown", action="store_true", help="let the Shutdown RPC stop the server")
    p.add_argument("--grace-seconds", type=float, default=defaults.grace_seconds,
                   help="time calls in flight get to finish when the server stops")
    p.add_argument("--no-reflection", dest="reflection", action="store_false", help="disable server reflection")
    args = vars(p.parse_args(argv))
    try:
        return ServeConfig(**{f.name: args[f.name] for f in fields(ServeConfig)})
    except ValueError as e:
        p.error(str(e))
