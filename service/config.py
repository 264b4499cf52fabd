"""ServeConfig: every server setting in one dataclass, validated once."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
EXECUTORS = ("llm", "paged")
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")
QUANTIZATIONS = ("none", "int8")
# Where the set-up (`make model`) converts the embedded SmolLM2-135M-Instruct: in the
# checkout, whatever directory the server is started from.
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                                 "smollm2-135m-instruct")
REFLECTION_MODES = ("on", "off", "authenticated")
# The flags only --executor llm reads (service/server.py: llm_config), by ServeConfig field. The
# paged executor would ignore them without a word: given with it, they are refused instead.
LLM_ONLY_FLAGS = {"model": "--model", "dtype": "--dtype", "device": "--device",
                  "kv_memory_fraction": "--kv-memory-fraction", "attention_backend": "--attention-backend",
                  "cuda_graphs": "--no-cuda-graphs", "step_overlap": "--no-step-overlap",
                  "triton_fused_ops": "--no-fused-kernels", "triton_gemv": "--triton-gemv",
                  "cpu_kernels": "--no-cpu-kernels",
                  "quantization": "--quantization", "lora_dir": "--lora-dir",
                  "max_loras": "--max-loras", "max_lora_rank": "--max-lora-rank",
                  "tensor_parallel_size": "--tensor-parallel-size",
                  "tensor_parallel_timeout_s": "--tensor-parallel-timeout-s"}
LOG_FORMATS = ("text", "json")


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
    # KV blocks in the pool; None: sized from free GPU memory on CUDA (after a warm-up forward,
    # within kv_memory_fraction of the device), 1024 on CPU and for the paged executor.
    num_blocks: int | None = None
    kv_memory_fraction: float = 0.90
    block_size: int = 16
    # Prefills reuse the K and V of cached prompt prefixes (kvcache/manager.py).
    prefix_caching: bool = True
    # Attention (executors/llm.py): auto is the Triton paged kernels on CUDA, torch SDPA on
    # CPU; decode steps on CUDA replay CUDA graphs unless cuda_graphs is off.
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    # A fed ARGMAX decode step through the graphs is left in flight while the next one is
    # launched (executors/step_overlap.py); off: each step finishes before the next starts.
    step_overlap: bool = True
    # The triton path's fused kernels (the attention prologue, the GLU), each once its start-up
    # check passed; off: those steps run as torch ops.
    triton_fused_ops: bool = True
    # Decode graphs of up to 8 rows: each matmul shape through the faster of torch's and a
    # Triton kernel that streams the weight once, timed at capture (few_row_matmuls.py).
    triton_gemv: bool = False
    # float32 on a CPU: decode steps through the AVX2 kernels of executors/cpu_kernels (built
    # with the system C compiler once per machine); off, or where they cannot be built, torch's ops.
    cpu_kernels: bool = True
    # int8: the matmul weights (and a tied embedding) stored as int8 with a float32 scale per
    # 32 inputs (llama.cpp's Q8_0 grouping), served by the CPU kernels; float32 CPU only.
    quantization: str = "none"
    # LoRA adapters (executors/adapters.py): every subdirectory of lora_dir holding a PEFT
    # adapter is loaded at start-up under its name; LoadLoraAdapter paths resolve under it.
    lora_dir: str | None = None
    max_loras: int = 8
    max_lora_rank: int = 64
    # Tensor parallelism (executors/parallel/): the model split over this many processes,
    # one per device. Alone, the service spawns ranks 1..N-1 on this host; under torchrun
    # every process runs the same command and torchrun's world must have N processes. A
    # collective that waits longer than the timeout (a rank hangs) breaks the executor.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 30.0
    # Limits, shown by GetCapabilities. Messages are capped on both ends: gRPC's default
    # of 4 MiB is below one 256-sequence step of full logits.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_batch_size: int = 64
    max_tokens_per_request: int = 65536
    max_concurrent_rpcs: int | None = None
    # A cache unused for this long is released (its client is presumed gone); 0 keeps caches forever.
    cache_ttl_seconds: float = 600.0
    # Concurrent Decode calls arriving within this window run as one batched forward
    # (executors/coalescer.py); a lone caller is never delayed. 0: off.
    coalesce_window_ms: float = 0.0
    # Lifecycle.
    warmup_on_start: bool = True
    allow_shutdown: bool = False
    grace_seconds: float = 5.0
    # Server reflection: "on", "off" or "authenticated" (needs credentials when auth is on);
    # None: "authenticated" when auth is on, else "on". True/False mean "on"/"off".
    reflection: str | bool | None = None
    # Security (service/auth.py): TLS, mutual TLS (client certificates verified against
    # tls_client_ca) and bearer tokens from a file of "IDENTITY TOKEN" lines or a variable.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_file: str | None = None
    auth_token_env: str | None = None
    # Observability (service/metrics.py, service/logs.py): Prometheus on this port (0: off), log format.
    metrics_port: int = 0
    log_format: str = "text"

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("block_size", "max_batch_size", "max_tokens_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (or unset: sized automatically), got {self.num_blocks}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not 1024 <= self.max_message_bytes <= 2**31 - 1:
            raise ValueError("max_message_bytes must be in [1024, 2**31 - 1] (protobuf caps messages at 2 GiB)")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError("max_concurrent_rpcs must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if not self.cache_ttl_seconds >= 0:
            raise ValueError(f"cache_ttl_seconds must be >= 0, got {self.cache_ttl_seconds}")
        if not 0 <= self.coalesce_window_ms <= 10_000:
            raise ValueError(f"coalesce_window_ms must be in [0, 10000], got {self.coalesce_window_ms}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.executor != "llm":
            raise ValueError("tensor parallelism splits a real model: it needs --executor llm")
        if self.tensor_parallel_size > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(f"with --tensor-parallel-size, --device is cpu or cuda (rank r takes its host's "
                             f"cuda:LOCAL_RANK), not {self.device!r}")
        if not 0 < self.tensor_parallel_timeout_s <= 3600:
            raise ValueError(f"tensor_parallel_timeout_s must be in (0, 3600], got {self.tensor_parallel_timeout_s}")
        if not 0 <= self.grace_seconds <= 3600:  # the bounds of the Shutdown RPC's grace_seconds; NaN fails too
            raise ValueError(f"grace_seconds must be in [0, 3600], got {self.grace_seconds}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "int8" and (self.device != "cpu" or self.dtype not in ("auto", "float32")
                                            or not self.cpu_kernels):
            raise ValueError("--quantization int8 runs on the float32 CPU kernels: it needs --device cpu, --dtype "
                             "float32 (or auto) and the CPU kernels (not --no-cpu-kernels)")
        if self.lora_dir is not None and not os.path.isdir(self.lora_dir):
            raise ValueError(f"lora_dir: {self.lora_dir!r} is not a directory")
        self._check_security_and_observability()

    def _check_security_and_observability(self) -> None:
        if isinstance(self.reflection, bool):
            object.__setattr__(self, "reflection", "on" if self.reflection else "off")
        if self.reflection not in (None, *REFLECTION_MODES):
            raise ValueError(f"reflection must be one of {REFLECTION_MODES}, got {self.reflection!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both (--tls-cert and --tls-key) or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs server TLS too: give --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            path = getattr(self, name)
            if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ValueError(f"{name}: {path!r} is not a readable file")
        if self.auth_token_env is not None and not self.auth_token_env.strip():
            raise ValueError("auth_token_env must name an environment variable")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (0: off), got {self.metrics_port}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")

    @property
    def auth_enabled(self) -> bool:
        """Callers must authenticate: bearer tokens are configured, or client certificates required."""
        return bool(self.auth_token_file or self.auth_token_env or self.tls_client_ca)

    @property
    def reflection_mode(self) -> str:
        """The reflection mode, "on", "off" or "authenticated", with its default resolved."""
        if self.reflection is None:
            return "authenticated" if self.auth_enabled else "on"
        return str(self.reflection)

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
    p.add_argument("--num-blocks", type=int, default=defaults.num_blocks,
                   help="KV blocks in the pool; default: sized from free GPU memory on CUDA, 1024 on CPU")
    p.add_argument("--kv-memory-fraction", type=float, default=defaults.kv_memory_fraction,
                   help="share of the GPU's total memory for weights, activations and the KV pool when "
                        "--num-blocks is not given; memory other processes hold counts against it "
                        "(default %(default)s)")
    p.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the K and V of cached prompt prefixes (on by default)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=defaults.attention_backend,
                   help="auto: Triton paged-attention kernels on CUDA, torch SDPA on CPU")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly on CUDA instead of replaying captured CUDA graphs")
    p.add_argument("--no-step-overlap", dest="step_overlap", action="store_false",
                   help="with decode CUDA graphs: finish each step (its tokens on the host, its caller "
                        "answered) before the next one is launched, instead of leaving fed plain ARGMAX steps "
                        "in flight while a step fed from them is staged and launched")
    p.add_argument("--no-fused-kernels", dest="triton_fused_ops", action="store_false",
                   help="with the Triton attention backend: run q/k norm, rotation, the K/V store and the MLP's "
                        "activation as torch ops instead of the fused Triton kernels")
    p.add_argument("--triton-gemv", dest="triton_gemv", action="store_true",
                   help="with decode CUDA graphs: run each matmul shape of buckets of up to 8 rows through the "
                        "faster of torch's and a Triton kernel that streams the weight once, timed at capture")
    p.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="float32 on a CPU: run decode steps on torch's ops (MKL, oneDNN) instead of the "
                        "AVX2 kernels of executors/cpu_kernels (matvecs, norms, paged decode attention)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=defaults.quantization,
                   help="int8: store the matmul weights as int8 with a float32 scale per 32 inputs (Q8_0's "
                        "grouping), a quarter of the bytes a decode step streams; float32 CPU only, with the "
                        "CPU kernels (default %(default)s)")
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="load every PEFT LoRA adapter directory under DIR at start-up (named after its "
                        "directory); LoadLoraAdapter paths resolve under DIR")
    p.add_argument("--max-loras", type=int, default=defaults.max_loras,
                   help="most LoRA adapters loaded at once (default %(default)s)")
    p.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank,
                   help="largest LoRA rank accepted (default %(default)s)")
    tp = p.add_argument_group("tensor parallelism", "one executor over several devices or hosts (see README)")
    tp.add_argument("--tensor-parallel-size", type=int, default=defaults.tensor_parallel_size, metavar="N",
                    help="split the model over N processes, one per device; alone it starts ranks 1..N-1 itself, "
                         "under torchrun the world must have N processes (default %(default)s)")
    tp.add_argument("--tensor-parallel-timeout-s", type=float, default=defaults.tensor_parallel_timeout_s,
                    metavar="S", help="a rank silent this long counts as failed: health NOT_SERVING, calls "
                                      "UNAVAILABLE (default %(default)s)")
    p.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes,
                   help="largest gRPC message sent or received (default 256 MiB)")
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size, help="most items per batch call")
    p.add_argument("--max-tokens-per-request", type=int, default=defaults.max_tokens_per_request,
                   help="most tokens in one request, over all its items")
    p.add_argument("--max-concurrent-rpcs", type=int, default=None,
                   help="refuse RPCs beyond this many in flight with RESOURCE_EXHAUSTED")
    p.add_argument("--cache-ttl-seconds", type=float, default=defaults.cache_ttl_seconds,
                   help="release a cache left unused this long; 0 never does (default %(default)s)")
    p.add_argument("--coalesce-window-ms", type=float, default=defaults.coalesce_window_ms,
                   help="run concurrent Decode calls arriving within this window as one batched forward; "
                        "a lone caller is never delayed; 0 is off (default %(default)s)")
    p.add_argument("--no-warmup", dest="warmup_on_start", action="store_false",
                   help="do not warm up at start; health stays NOT_SERVING until a Warmup call")
    p.add_argument("--allow-shutdown", action="store_true", help="let the Shutdown RPC stop the server")
    p.add_argument("--grace-seconds", type=float, default=defaults.grace_seconds,
                   help="time calls in flight get to finish when the server stops")
    p.add_argument("--reflection", choices=REFLECTION_MODES, default=None,
                   help="server reflection: on, off, or authenticated (needs credentials); "
                        "default: authenticated when auth is on, else on")
    sec = p.add_argument_group("security", "TLS, mutual TLS and bearer tokens (see README)")
    sec.add_argument("--tls-cert", default=None, metavar="PATH", help="server certificate chain (PEM); enables TLS")
    sec.add_argument("--tls-key", default=None, metavar="PATH", help="server private key (PEM)")
    sec.add_argument("--tls-client-ca", default=None, metavar="PATH",
                     help="CA bundle (PEM) for client certificates: requires and verifies them (mutual TLS); "
                          "a call without a token is the certificate's subject CN")
    sec.add_argument("--auth-token-file", default=None, metavar="PATH",
                     help="bearer tokens: lines 'IDENTITY TOKEN', or one bare token (identity 'default'); "
                          "# comments")
    sec.add_argument("--auth-token-env", default=None, metavar="VAR",
                     help="environment variable holding one bearer token (identity 'default')")
    obs = p.add_argument_group("observability")
    obs.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                     help="serve Prometheus metrics on --host at this port; 0 is off (default %(default)s)")
    obs.add_argument("--log-format", choices=LOG_FORMATS, default=defaults.log_format,
                     help="log lines (one per RPC among them) as text or JSON (default %(default)s)")
    # The llm-only flags start out unset, so that a flag given is told from a default.
    unset = object()
    args = vars(p.parse_args(argv, argparse.Namespace(**dict.fromkeys(LLM_ONLY_FLAGS, unset))))
    given = [flag for name, flag in LLM_ONLY_FLAGS.items() if args[name] is not unset]
    if args["executor"] != "llm" and given:
        p.error(f"{given[0]} is a flag of --executor llm; the {args['executor']} executor does not use it")
    args.update({name: getattr(defaults, name) for name in LLM_ONLY_FLAGS if args[name] is unset})
    try:
        return ServeConfig(**{f.name: args[f.name] for f in fields(ServeConfig)})
    except ValueError as e:
        p.error(str(e))
