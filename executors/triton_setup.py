"""The triton path's start-up checks: which attention backend runs, and which fused kernels.

Each Triton kernel compiles per GPU and per Triton version, so each is run at the model's
shapes on this device before it serves, against the torch computation it replaces: a kernel
that fails to build, or computes wrongly, here turns into a refusal (an explicit
`--attention-backend triton`), a fall-back to SDPA (`auto`), or, for a fused kernel, the torch
ops it replaces, each with a warning that says why. Used by LlmExecutor and by tensor
parallelism's ranks (executors/parallel/rank.py).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executors.llm import LlmExecutorConfig
    from executors.models.config import DecoderConfig
    from executors.models.decoder import DecoderLM
    from executors.models.few_row_matmuls import FewRowMatmuls
    from executors.models.triton_glu import FusedGlu
    from executors.models.triton_prologue import QkvPrologue

log = logging.getLogger(__name__)


def attention_backend(config: LlmExecutorConfig, mc: DecoderConfig) -> str:
    """The backend to run: sdpa, or triton once its kernels passed a start-up check at the
    model's shapes on this device (executors/models/triton_attention.py `self_check`)."""
    wanted = config.attention_backend
    if wanted == "sdpa":
        return "sdpa"
    cuda = config.device.startswith("cuda")
    have_triton = importlib.util.find_spec("triton") is not None
    if wanted == "auto" and not (cuda and have_triton):
        return "sdpa"
    if mc.attn_softcap is not None:  # the kernels do not cap scores; attention.py's plain path does
        if wanted == "triton":
            raise ValueError("attention_backend triton: the Triton kernels do not soft-cap attention scores "
                             f"(attn_logit_softcapping {mc.attn_softcap}); use sdpa or auto")
        log.warning("Triton paged attention is off, SDPA's plain path serves instead: the model soft-caps its "
                    "attention scores (attn_logit_softcapping %s), which the kernels do not", mc.attn_softcap)
        return "sdpa"
    if not have_triton:
        raise ValueError("attention_backend triton needs the triton package, which is not installed")
    from executors.models import triton_attention

    if not cuda and not triton_attention.interpreted():
        raise ValueError("attention_backend triton runs on CUDA; on a CPU only in Triton's interpreter "
                         "(TRITON_INTERPRET=1 before triton is imported; slow, for tests)")
    log.info("checking the Triton paged-attention kernels against SDPA at the model's shapes (they compile first)")
    problem = triton_attention.self_check(config.device, config.torch_dtype, mc.num_heads, mc.num_kv_heads,
                                          mc.head_dim, config.block_size, sinks=mc.attention_sinks)
    if problem is None:
        return "triton"
    if wanted == "auto":
        log.warning("Triton paged attention is off, SDPA serves instead: %s", problem)
        return "sdpa"
    raise ValueError(f"attention_backend triton: {problem}")


def fused_ops(config: LlmExecutorConfig, model: DecoderLM) -> tuple[QkvPrologue | None, FusedGlu | None]:
    """The triton path's fused kernels (executors/models/triton_prologue.py, triton_glu.py),
    each once it passed its start-up check at the model's shapes; None for one that did not,
    with a warning that says why."""
    from executors.models import triton_glu, triton_prologue

    c = model.config
    prologue = glu = None
    if c.mla is not None:
        problem = "its latent attention rotates its own rope dimensions (DeepSeek, mla.py), not the cached rows' heads"
    elif c.qk_norm_across_heads:
        problem = "its q/k norms span every head (OLMo 2), where the kernel norms each head alone"
    elif c.qk_norm and c.layer_norm:
        problem = "its q/k norms are LayerNorms with a weight per head (Command R+), where the kernel's are RMSNorms"
    else:
        problem = triton_prologue.self_check(config.device, config.torch_dtype, c.num_heads, c.num_kv_heads,
                                             c.head_dim, qk_norm=any(w.q_norm is not None for w in model.fused))
    if problem is None:
        prologue = triton_prologue.QkvPrologue(model)
    else:
        log.warning("the fused attention prologue is off, q/k norm, rotation and the K/V store run as torch "
                    "ops: %s", problem)
    problem = triton_glu.self_check(config.device, config.torch_dtype, c.hidden_act)
    if problem is None:
        glu = triton_glu.FusedGlu(c.hidden_act)
    else:
        log.warning("the fused GLU is off, the activation and the multiply run as torch ops: %s", problem)
    return prologue, glu


def few_row_matmuls(config: LlmExecutorConfig, model: DecoderLM) -> FewRowMatmuls | None:
    """The decode graphs' few-row matmuls (executors/models/few_row_matmuls.py) where the config
    asks for them: timed against torch's on CUDA, the first block shape that computes right in
    Triton's interpreter (tests on a CPU)."""
    if not config.triton_gemv:
        return None
    if model.cpu_kernels is not None:  # a CPU's float32 weights are the kernels' panels: those run them
        log.warning("triton_gemv is on but the CPU kernels run this model's matmuls: it does not apply")
        return None
    from executors.models import few_row_matmuls as matmuls

    weights = [t for w in model.fused for t in w.matmuls()]
    return matmuls.FewRowMatmuls(weights, timer=matmuls.device_ms if config.device.startswith("cuda") else None)
