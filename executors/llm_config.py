"""LlmExecutorConfig: what an LlmExecutor is asked to serve and how, validated once when it is made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LlmExecutorConfig:
    model_dir: str
    dtype: str = "auto"  # float32, bfloat16, float16; auto: float32 on CPU, bfloat16 on CUDA
    device: str = "cpu"
    # KV blocks in the pool. None ("auto"): on CUDA, sized from device memory after a warm-up
    # forward (executors/kv_sizing.py); on CPU, 1024: host memory is shared with everything
    # else on the machine and has no allocator to ask, so there is nothing sound to size from.
    num_blocks: int | None = None
    # The share of the device's total memory this process may fill with weights, activations
    # and KV when num_blocks is auto (vLLM's gpu_memory_utilization). Memory other processes
    # hold counts against it: the pool must fit in what is actually free.
    kv_memory_fraction: float = 0.90
    block_size: int = 16
    max_batch_size: int = 64
    max_sequence_length: int | None = None  # default: the model's max_position_embeddings
    prefix_caching: bool = True
    # LoRA: adapters loaded at start-up from the subdirectories of lora_dir (and by path
    # under it at run time); at most max_loras at once, ranks up to max_lora_rank.
    lora_dir: str | None = None
    max_loras: int = 8
    max_lora_rank: int = 64
    # Attention: "sdpa" (torch's scaled_dot_product_attention over pool views and block
    # gathers), "triton" (paged kernels that read K and V through the block tables), or
    # "auto": triton on CUDA when the triton package is importable, sdpa otherwise.
    attention_backend: str = "auto"
    # On CUDA with the triton backend: replay decode steps from CUDA graphs captured at
    # start-up for batch-size buckets (executors/decode_graphs.py).
    cuda_graphs: bool = True
    # With decode graphs: a fed step whose rows all want a plain ARGMAX token is left in flight
    # on the device while the worker stages and launches the next (executors/step_overlap.py).
    step_overlap: bool = True
    # With the triton backend: a layer's q/k norm, rotation and K/V store as one Triton kernel
    # (executors/models/triton_prologue.py) and the GLU as one (triton_glu.py), each once its
    # start-up check passed; False runs them as torch ops (the bench compares the two).
    triton_fused_ops: bool = True
    # With decode CUDA graphs: the matmuls of buckets of up to 8 rows through the faster, shape
    # by shape, of torch's and a Triton kernel that streams the weight once
    # (executors/models/few_row_matmuls.py), chosen by timing both at capture.
    triton_gemv: bool = False
    # float32 on a CPU: decode steps through the AVX2 kernels of executors/cpu_kernels (built
    # with the system C compiler once per machine); off, or where they cannot be built, torch's
    # ops (MKL, oneDNN, SDPA) run them.
    cpu_kernels: bool = True
    # "int8": the CPU kernels' weights as int8 panels with a float32 scale per 32 inputs
    # (executors/cpu_kernels/qpanels.py); "none": float32. int8 needs a float32 CPU model
    # with the kernels built.
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (or None: sized automatically), got {self.num_blocks}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise ValueError(f"attention_backend must be auto, sdpa or triton, got {self.attention_backend!r}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.lora_dir is not None and not Path(self.lora_dir).is_dir():
            raise ValueError(f"lora_dir {self.lora_dir!r} is not a directory")
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"quantization must be none or int8, got {self.quantization!r}")
        if self.quantization == "int8" and (self.device != "cpu" or self.torch_dtype != torch.float32
                                            or not self.cpu_kernels):
            raise ValueError("quantization int8 runs on the float32 CPU kernels: it needs device cpu, dtype float32 "
                             "(or auto) and cpu_kernels on")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return TORCH_DTYPES[self.dtype]
