"""Tensor <-> protobuf `dspark.v1.Tensor` (raw bytes + dtype + shape), the only place the two meet.

Owns the wire encoding of tensors and its checks (dtype, shape, byte length, element limit);
it never interprets what a tensor means: which shape a rows tensor must have is the engines'.

Hidden rows travel as bfloat16 (docs/architecture.md §6): [R, row_width] rows of 4096·3 values
cost 24 KB each instead of ~100 KB as repeated floats.
"""

from __future__ import annotations

import math

import torch

from dspark_proto.v1 import common_pb2
from services.common.device import to_host

_WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int64": torch.int64}
_BIT_VIEWS = {torch.bfloat16: torch.int16}  # dtypes numpy cannot hold travel as their bits


def to_proto(t: torch.Tensor, dtype: str = "bfloat16") -> common_pb2.Tensor:
    """Encode t (any shape, any device) as `dtype` ("bfloat16" | "float32" | "int64")
    little-endian bytes. A device tensor is cast on its device (fewer bytes cross) and then
    crosses to the host once, into a pinned buffer (`services.common.device.to_host`).

    Raises:
        ValueError: unknown dtype.
    """
    if dtype not in _WIRE_DTYPES:
        raise ValueError(f"wire dtype {dtype!r}: must be one of {sorted(_WIRE_DTYPES)}")
    x = to_host(t.detach().to(_WIRE_DTYPES[dtype]).contiguous())
    bits = x.view(_BIT_VIEWS.get(x.dtype, x.dtype))
    return common_pb2.Tensor(data=bits.numpy().tobytes(), dtype=dtype, shape=list(x.shape))


def from_proto(msg: common_pb2.Tensor, max_elements: int | None = None) -> torch.Tensor:
    """Decode a `Tensor` message into a new CPU tensor of its wire dtype.

    Raises:
        ValueError: unknown dtype, negative dims, more than `max_elements` elements, or a
            byte length that does not match dtype and shape (all named).
    """
    if msg.dtype not in _WIRE_DTYPES:
        raise ValueError(f"tensor dtype {msg.dtype!r}: must be one of {sorted(_WIRE_DTYPES)}")
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    n = math.prod(shape)
    if max_elements is not None and n > max_elements:
        raise ValueError(f"tensor shape {list(shape)} holds {n} elements, limit {max_elements}")
    dtype = _WIRE_DTYPES[msg.dtype]
    view = _BIT_VIEWS.get(dtype, dtype)
    itemsize = torch.empty((), dtype=view).element_size()
    if len(msg.data) != n * itemsize:
        raise ValueError(f"tensor of dtype {msg.dtype} and shape {list(shape)} needs {n * itemsize} bytes, "
                         f"got {len(msg.data)}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=view).view(dtype).reshape(shape)
