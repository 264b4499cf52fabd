"""Loading a Hugging Face layout directory (config.json + safetensors) into a DecoderLM.

Tensors are read through safetensors' memory map, one at a time, converted to the serving
dtype and moved to the device, so peak host memory stays near one copy of the weights.
Every expected tensor must be present with its exact shape; anything else is an error
that names the tensor, raised at start-up. GPT-OSS's MXFP4 experts (a `_blocks` and a
`_scales` tensor each) and block-wise FP8 weights (a `weight_scale_inv` beside each) are
dequantized as they are read (mxfp4.py, fp8_blocks.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from executors.cpu_kernels.qpanels import QGROUP, quantize
from executors.models import fp8_blocks, mxfp4
from executors.models.checkpoint_sections import RowWindow, fused_sections, fused_shape, text_tensor_name
from executors.models.config import DecoderConfig, UnsupportedModel
from executors.models.decoder import DecoderLM
from executors.models.served_tensors import served, stored_shape
from executors.models.stacked_experts import TRANSPOSED

if TYPE_CHECKING:
    from executors.parallel.shard import ShardPlan

log = logging.getLogger(__name__)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Families whose checkpoints hold layers past num_hidden_layers that transformers does not
# load either: GLM-4.5's and DeepSeek V3's multi-token-prediction layer(s).
EXTRA_LAYER_FAMILIES = ("glm4_moe", "deepseek_v3")
# Parameters kept in float32 whatever the serving dtype, as transformers keeps them: GLM-4.5's
# router correction, which decides between close scores.
FLOAT32_SUFFIXES = ("e_score_correction_bias",)


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise UnsupportedModel(f"{model_dir}: shards named by the index are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise UnsupportedModel(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def tensor_bytes(path: Path) -> dict[str, int]:
    """The bytes of each tensor of a safetensors file, from its header (no tensor is read)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: meta["data_offsets"][1] - meta["data_offsets"][0] for name, meta in header.items()
            if name != "__metadata__"}


class _Progress:
    """'loading NAME: P% of T MB' every tenth of the bytes, and at 100%."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done, self.next = name, max(total, 1), 0, 0.1

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.done >= self.next * self.total or self.done >= self.total:
            log.info("loading %s: %3.0f%% of %.0f MB", self.name, 100 * self.done / self.total, self.total / 1e6)
            while self.next * self.total <= self.done:
                self.next += 0.1


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device,
               shard: Callable[[DecoderConfig], ShardPlan] | None = None, cpu_kernels: bool = True,
               quantize_weights: bool = False) -> DecoderLM:
    """`shard`: under tensor parallelism, the plan of this rank's slices (given the model's
    config); only those slices are read from the files. `cpu_kernels`: float32 on a CPU, run
    the steps through the AVX2 kernels where they build (executors/cpu_kernels), the matmul
    weights stored as their panels (panel_modules.py); `quantize_weights`: those panels as
    int8 with float32 scales (cpu_kernels/qpanels.py)."""
    model_dir = Path(model_dir)
    config = DecoderConfig.from_dir(model_dir)
    plan = shard(config) if shard is not None else None
    if plan is not None and quantize_weights:
        # A rank's row-parallel matmuls (o, down) take a slice of the inputs: int8 groups of
        # 32 inputs match the whole model's only where every slice starts at a multiple of 32.
        local = plan.local_config()
        for name, inputs in (("attention output", local.num_heads * plan.head_width("o_proj")),
                             ("MLP down", local.intermediate_size)):
            if inputs % QGROUP:
                raise UnsupportedModel(f"int8 weights under tensor parallelism need each rank's {name} inputs to be a "
                                       f"multiple of {QGROUP}; this split gives each rank {inputs}")
    with torch.device("meta"):
        model = DecoderLM(config) if plan is None else DecoderLM(plan.local_config(), plan.head_rows)
        full = model if plan is None else DecoderLM(config)
    expected_full = {name: tuple(p.shape) for name, p in full.named_parameters()}
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    files = weight_files(model_dir)
    sizes = {path: tensor_bytes(path) for path in files}
    total = sum(sum(s.values()) for s in sizes.values())
    log.info("loading %s (%s, %.0f MB in %d file%s) as %s onto %s", model_dir.name, config.architecture, total / 1e6,
             len(files), "" if len(files) == 1 else "s", str(dtype).removeprefix("torch."), device)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    halves: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 matrix's blocks or scales, till both are read
    fp8 = fp8_blocks.ScaledWeights(files, config.fp8_block)
    progress, started = _Progress(model_dir.name, total), time.perf_counter()
    sections = fused_sections(config)  # Phi-3's qkv_proj, GLM-4's gate_up_proj and norms: cut or renamed
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():
                progress.add(sizes[path].get(stored, 0))  # read, or skipped: done with it either way
                name = text_tensor_name(stored, config)  # a multimodal checkpoint's text model by our names
                if name is None:  # its vision tower or projector: not served
                    continue
                if fp8.is_scale(stored):  # read with its weight
                    continue
                if name in sections:
                    parts = sections[name]
                    # One process reads the whole tensor; a rank only its rows of each part.
                    fused = fp8.weight(f, path, stored) if plan is None or fp8.scaled(stored) else f.get_slice(stored)
                    shape = tuple(fused.shape) if plan is None else tuple(fused.get_shape())
                    want = fused_shape(parts, expected_full)
                    if shape != want:
                        raise UnsupportedModel(f"{path.name}: tensor {stored} has shape {shape}, the config implies {want}")
                    for part, lo, hi in parts:
                        mine = fused[lo:hi] if plan is None else plan.read(part, RowWindow(fused, lo, hi),
                                                                          (hi - lo, *shape[1:]))
                        state[part] = _converted(served(part, mine, config), dtype, device)
                    continue
                quantized = _mxfp4_part(name, config)
                if quantized is not None and quantized[0] in expected:
                    base, part = quantized
                    halves.setdefault(base, {})[part] = f.get_tensor(stored)
                    if len(halves[base]) < 2:
                        continue
                    pair = halves.pop(base)
                    # As the checkpoint's unquantized tensor ([E, hidden, 2I], x @ it): a view
                    name, stored = base, base + mxfp4.BLOCKS
                    tensor = piece = mxfp4.dequantize(pair[mxfp4.BLOCKS], pair[mxfp4.SCALES],
                                                      _mxfp4_dtype(dtype)).transpose(1, 2)
                    shape = tuple(tensor.shape)
                elif name not in expected:
                    tied_head = name == "lm_head.weight" and config.tie_word_embeddings
                    if not tied_head and not name.endswith(IGNORED_SUFFIXES) and not _extra_layer(name, config):
                        unexpected.append(stored)
                    continue
                elif plan is None or fp8.scaled(stored):  # (an FP8 matrix: dequantized whole, then a rank's part)
                    tensor = piece = fp8.weight(f, path, stored)
                    shape = tuple(tensor.shape)
                else:
                    piece = f.get_slice(stored)
                    shape = tuple(piece.get_shape())
                want = stored_shape(name, expected_full[name], config)
                if shape != want:
                    raise UnsupportedModel(f"{path.name}: tensor {stored} has shape {shape}, the config implies {want}")
                if plan is not None:
                    tensor = plan.read(name, piece, shape)
                state[name] = _converted(served(name, tensor, config), _serving_dtype(name, dtype), device)
    for base, pair in halves.items():
        found, lacking = next(iter(pair)), ({mxfp4.BLOCKS, mxfp4.SCALES} - set(pair)).pop()
        raise UnsupportedModel(f"{model_dir}: MXFP4 tensor {base}{found} has no {base}{lacking} beside it")
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise UnsupportedModel(f"{model_dir}: missing tensors: {shown}")
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5])
        raise UnsupportedModel(f"{model_dir}: tensors the {config.architecture} config does not expect: {shown}")
    model.load_state_dict(state, assign=True, strict=True)
    state.clear()  # the model holds the tensors now: fusing and packing free each one it replaces
    model.reset_buffers(device)  # rotary tables and expert-load counters: built, not loaded
    log.info("fusing %s's q/k/v and gate/up weights for the fast forward", model_dir.name)
    model.use_cpu_kernels = cpu_kernels
    model.quantize_weights = quantize_weights
    model.fuse()  # the fast forward's fused q/k/v and gate/up weights; the parameters become views
    log.info("loaded %s (%s) in %.1f s", model_dir.name, config.architecture, time.perf_counter() - started)
    return model.eval()


def _mxfp4_part(name: str, config: DecoderConfig) -> tuple[str, str] | None:
    """(the matrix, BLOCKS or SCALES) for half of one of GPT-OSS's MXFP4 expert matrices; None otherwise."""
    part = mxfp4.parts(name)
    if part is None or config.moe is None or config.moe.style != "gpt_oss" or not part[0].endswith(TRANSPOSED):
        return None
    return part


def _mxfp4_dtype(dtype: torch.dtype) -> torch.dtype:
    """What MXFP4 values are dequantized to: float32 for a float32 model, else bfloat16 (exact)."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def _serving_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FLOAT32_SUFFIXES) else dtype


def _extra_layer(name: str, config: DecoderConfig) -> bool:
    """A tensor of a layer past num_hidden_layers, in a family whose checkpoints have such layers."""
    parts = name.split(".")
    return (config.family in EXTRA_LAYER_FAMILIES and len(parts) > 2 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and int(parts[2]) >= config.num_layers)


def _converted(tensor: torch.Tensor, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    converted = tensor.to(dtype=dtype, device=device)
    if converted.dim() == 1 and converted.data_ptr() == tensor.data_ptr():
        # Already in the serving dtype and device, a tensor is a view of the file's memory map,
        # and one such view kept alive keeps the whole map resident, every page the load
        # touched, beside the model's own copy of the weights. Matrices are repacked by fuse()
        # (or served from the map where they are not); vectors (norms, biases) are kept as
        # loaded, so they get memory of their own here.
        converted = converted.clone()
    return converted


def checkpoint_parameters(model_dir: str | Path, dtype: torch.dtype,
                          int8: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's parameters as one process serves them, read from the files one at a
    time: named_parameters() order and names, each tensor in the serving dtype, those named in
    `int8` quantized and dequantized as the int8 panels serve them (rows are quantized one by
    one, so a whole matrix gives what each rank's slices do).

    A tensor-parallel rank holds only its slices, yet its KV caches must carry the digest a
    single process of the same checkpoint would compute (executors/kv_moves.py), so that caches
    move between executors however each is split; tests/test_tensor_parallel_transfer.py checks
    that this equals the loaded model's logical_parameters() for every family."""
    model_dir = Path(model_dir)
    config = DecoderConfig.from_dir(model_dir)
    with torch.device("meta"):
        names = [name for name, _ in DecoderLM(config).named_parameters()]
    sections = {part: (fused, lo, hi) for fused, parts in fused_sections(config).items() for part, lo, hi in parts}
    with contextlib.ExitStack() as files:  # each file opened once, for every tensor it holds
        found = {}
        stored_as = {}  # our name -> the file's (a multimodal checkpoint's text model)
        fp8_scales = {}  # a block-wise FP8 checkpoint's scales: stored name -> its open file
        for path in weight_files(model_dir):
            f = files.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for stored in f.keys():
                if config.fp8_block is not None and stored.endswith(fp8_blocks.SCALE_SUFFIX):
                    fp8_scales[stored] = f
                    continue
                name = text_tensor_name(stored, config)
                if name is not None:
                    found[name], stored_as[name] = f, stored

        def read(name: str) -> torch.Tensor:  # as the loader reads it: FP8 dequantized
            stored = stored_as[name]
            tensor = found[name].get_tensor(stored)
            scale = fp8_scales.get(stored + fp8_blocks.SCALE_SUFFIX)
            return tensor if scale is None else fp8_blocks.dequantize(
                tensor, scale.get_tensor(stored + fp8_blocks.SCALE_SUFFIX), config.fp8_block)

        missing = [name for name in names if sections.get(name, (name,))[0] not in found
                   and not {name + mxfp4.BLOCKS, name + mxfp4.SCALES} <= set(found)]
        if missing:
            raise UnsupportedModel(f"{model_dir}: missing tensors: {', '.join(missing[:5])}")
        last_fused: tuple[str, torch.Tensor] | None = None  # q, k and v (gate and up) follow one another
        for name in names:
            if name in sections:
                fused, lo, hi = sections[name]
                if last_fused is None or last_fused[0] != fused:
                    last_fused = (fused, read(fused))
                tensor = last_fused[1][lo:hi]
            elif name not in found:  # GPT-OSS's MXFP4 experts, as the loader reads them
                blocks, scales = (found[name + s].get_tensor(stored_as[name + s]) for s in (mxfp4.BLOCKS, mxfp4.SCALES))
                tensor = mxfp4.dequantize(blocks, scales, _mxfp4_dtype(dtype)).transpose(1, 2)
            else:
                tensor = read(name)
            # as the loader: served, then the dtype
            tensor = served(name, tensor, config).to(_serving_dtype(name, dtype))
            if name in int8:  # stacked experts: each expert's matrix quantized on its own, as packed
                tensor = torch.stack([quantize(t).unpack() for t in tensor]) if tensor.dim() == 3 else \
                    quantize(tensor).unpack()
            yield name, tensor
