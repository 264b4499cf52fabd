"""Compile the kernels of this directory into one shared library once per machine, and load it.

The library is built with the system C compiler the first time a process asks for it and
kept in a cache directory keyed by a hash of the source, the flags and the compiler, so
later processes (and the service's tensor-parallel ranks) load it in milliseconds.
`make install` builds it ahead (`python -m executors.cpu_kernels`). Where it cannot be
built (no compiler, a CPU without AVX2 and FMA, not Linux on x86-64), `build_library()` says why
and the model runs its matmuls through torch as before.

The flags name AVX2 and FMA rather than -march=native: a cache shared between machines
(a container image built on one host, run on another) must not hold code for the build
host's newer instructions. The AVX-512 paths are functions of their own target attribute,
run only where the CPU says it has AVX-512 (isa.h).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("weight_panel.c", "pointwise.c", "paged_attention.c", "prefill_attention.c",
                                           "argmax.c", "sampling.c", "decode_step.c", "fma_rate.c"))
HEADERS = tuple(HERE / name for name in ("simd.h", "isa.h", "panel.h", "weight_panel.h", "pack_x.h",
                                          "weight_panel512.h", "weight_linear.h", "weight_q8_dot.h", "weight_q8.h",
                                          "pointwise.h", "attention_row.h", "decode_layer.h"))
FLAGS = ("-O3", "-std=c11", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")
LIBS = ("-lm",)
LIBRARY = "libmodelexec_cpu.so"


class KernelsUnavailable(RuntimeError):
    """Why the CPU kernels cannot be built or loaded here (the caller falls back to torch)."""


def cache_root() -> Path:
    """$XDG_CACHE_HOME/modelexec (~/.cache/modelexec), read when a build is asked for."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modelexec"


def compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    raise KernelsUnavailable("no C compiler on PATH (cc, gcc or clang; or set CC)")


def check_cpu() -> None:
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelsUnavailable(f"built for Linux on x86-64, this is {sys.platform} on {platform.machine()}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):  # torch's AVX2 level implies FMA as well
        raise KernelsUnavailable(f"needs AVX2 and FMA; torch reports this CPU's capability as {capability}")


def _key(cc: str) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"{cc} --version failed: {e}") from e
    digest = hashlib.sha256(version.encode() + " ".join(FLAGS + LIBS).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def build_library(cache: Path | None = None) -> Path:
    """The path of the built library: from the cache, or compiled into it now."""
    check_cpu()
    cc = compiler()
    target = (cache or cache_root()) / f"kernels-{_key(cc)}" / LIBRARY
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelsUnavailable(f"cannot create the kernel cache {target.parent}: {e}") from e
    # Compile beside the target and rename: concurrent builders (ranks, test workers) each
    # write their own file, and the rename makes whichever finishes last the one in place.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", partial, *LIBS],
                              capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise KernelsUnavailable(f"{cc} failed to compile the CPU kernels: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"compiling the CPU kernels with {cc} failed: {e}") from e
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load_library(path: Path) -> ctypes.CDLL:
    """Load the library. torch is imported first, so the library's libgomp.so.1 resolves to
    the one torch loaded (the same soname): one OpenMP runtime, one thread pool."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelsUnavailable(f"cannot load {path}: {e}") from e
