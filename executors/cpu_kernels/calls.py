"""What every ctypes wrapper of the kernels shares: the C argument types, the dtypes the
wrappers check, binding a function, and the error for an argument the C side would misread."""

from __future__ import annotations

import ctypes

import torch

# C argument types: a pointer, int64_t, int, float.
C_PTR, C_INT64, C_INT, C_FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
F32, I64, I32, I8 = torch.float32, torch.int64, torch.int32, torch.int8


def bind(library: ctypes.CDLL, name: str, argtypes: list, restype=None):
    fn = getattr(library, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def refused(fn: str, name: str, t: object, want: str, dtype: torch.dtype | None = None) -> TypeError | ValueError:
    """The error for argument `name` of CpuKernels.`fn`, which is not `want`: a TypeError where
    it is not a tensor or not of `dtype`, a ValueError for the rest (shape, strides, device)."""
    if not isinstance(t, torch.Tensor):
        return TypeError(f"CpuKernels.{fn}: {name} must be {want}, not {type(t).__name__}")
    kind = TypeError if dtype is not None and t.dtype != dtype else ValueError
    return kind(f"CpuKernels.{fn}: {name} must be {want}; got {t.dtype} on {t.device.type} of shape "
                f"{tuple(t.shape)}, strides {t.stride()}")
