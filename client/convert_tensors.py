"""Tensors and dtypes on the wire: ndarray <-> Tensor, and bfloat16 as raw uint16 bits.

The lowest layer of the client's conversions (client.convert re-exports it): FULL logits
rows and Forward outputs travel as Tensors, and NumPy has no bfloat16, so the bit-level
rounding to and from float32 lives here too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._proto import executor_pb2 as pb

# Wire layout of each DataType; BFLOAT16 is carried as raw uint16 bits (NumPy has no bf16).
_WIRE_DTYPES: dict[int, np.dtype] = {
    pb.DATA_TYPE_FLOAT32: np.dtype("<f4"),
    pb.DATA_TYPE_FLOAT16: np.dtype("<f2"),
    pb.DATA_TYPE_BFLOAT16: np.dtype("<u2"),
    pb.DATA_TYPE_INT32: np.dtype("<i4"),
    pb.DATA_TYPE_INT64: np.dtype("<i8"),
    pb.DATA_TYPE_UINT32: np.dtype("<u4"),
    pb.DATA_TYPE_INT8: np.dtype("i1"),
    pb.DATA_TYPE_UINT8: np.dtype("u1"),
    pb.DATA_TYPE_BOOL: np.dtype("?"),
}

DTYPE_BY_NAME: dict[str, int] = {
    "float32": pb.DATA_TYPE_FLOAT32,
    "float16": pb.DATA_TYPE_FLOAT16,
    "bfloat16": pb.DATA_TYPE_BFLOAT16,
    "int32": pb.DATA_TYPE_INT32,
    "int64": pb.DATA_TYPE_INT64,
    "uint32": pb.DATA_TYPE_UINT32,
    "int8": pb.DATA_TYPE_INT8,
    "uint8": pb.DATA_TYPE_UINT8,
    "bool": pb.DATA_TYPE_BOOL,
}

# DataType inferred from an ndarray's own dtype when the caller names none.
_DTYPE_BY_NUMPY: dict[np.dtype, int] = {
    np.dtype(v).newbyteorder("="): k for k, v in _WIRE_DTYPES.items() if k != pb.DATA_TYPE_BFLOAT16
}


def data_type(dtype: str | int) -> int:
    """A DataType enum value from its short name ("bfloat16") or the enum itself."""
    if isinstance(dtype, str):
        try:
            return DTYPE_BY_NAME[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BY_NAME)}") from None
    if int(dtype) not in _WIRE_DTYPES:
        raise ValueError(f"unsupported DataType {dtype!r}")
    return int(dtype)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact bf16 -> fp32: bf16 is the upper half of an fp32, so shift and reinterpret."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits with round-to-nearest-even, keeping NaNs NaN (as torch does)."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def tensor_to_ndarray(tensor: pb.Tensor) -> np.ndarray:
    """Decode a Tensor, checking its byte length against its shape.

    BFLOAT16 comes out as float32 (exact). Other dtypes are zero-copy, read-only views
    over the message bytes: a logits row is decoded on every step, so no copy is made.
    """
    if tensor.dtype not in _WIRE_DTYPES:
        raise ValueError(f"Tensor has unsupported dtype {tensor.dtype}")
    wire = _WIRE_DTYPES[tensor.dtype]
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"Tensor shape {shape} has a negative dimension")
    data = tensor.data
    expected = math.prod(shape) * wire.itemsize
    if len(data) != expected:
        raise ValueError(
            f"Tensor of dtype {pb.DataType.Name(tensor.dtype)} and shape {list(shape)} needs "
            f"{expected} bytes, got {len(data)}"
        )
    if tensor.dtype == pb.DATA_TYPE_BOOL:
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size and raw.max() > 1:
            raise ValueError("BOOL Tensor holds a byte other than 0 or 1")
    array = np.frombuffer(data, dtype=wire).reshape(shape)
    if tensor.dtype == pb.DATA_TYPE_BFLOAT16:
        return bfloat16_bits_to_float32(array)
    if not wire.isnative:
        array = array.astype(wire.newbyteorder("="))
    return array


def ndarray_to_tensor(array: Any, dtype: str | int | None = None) -> pb.Tensor:
    """Encode an array as a row-major little-endian Tensor.

    With no dtype the array's own dtype must map to a DataType (float64 does not: name
    one). For BFLOAT16 a uint16 array is taken as raw bits, anything else is rounded.
    """
    a = np.asarray(array)
    if dtype is None:
        try:
            code = _DTYPE_BY_NUMPY[a.dtype.newbyteorder("=")]
        except KeyError:
            raise ValueError(f"no DataType for numpy dtype {a.dtype}; pass dtype=") from None
    else:
        code = data_type(dtype)
    if code == pb.DATA_TYPE_BFLOAT16:
        bits = a.astype(np.uint16) if a.dtype == np.uint16 else float32_to_bfloat16_bits(a)
        data = bits.astype("<u2").tobytes()
    else:
        data = a.astype(_WIRE_DTYPES[code], copy=False).tobytes(order="C")
    return pb.Tensor(dtype=code, shape=a.shape, data=data)
