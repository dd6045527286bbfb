"""Argument helpers shared by the kernel wrappers."""

from __future__ import annotations

import torch


def out_tensor(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
               who: str) -> torch.Tensor:
    """The wrapper's destination: `out` after checking shape, dtype, device and a unit stride on
    the last dim (leading dims may be strided), or a new uninitialised tensor.

    Raises:
        ValueError: naming `who` and what differs.
    """
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"{who}: out must be {dtype} {shape} on {device} with unit last stride, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}, strides {out.stride()}")
    return out
