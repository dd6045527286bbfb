"""Helpers shared by the kernel wrappers: where the kernels run (`interpreting`), and their
destinations (`out_tensor`). This module owns those two checks and computes nothing."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter.

    `TRITON_INTERPRET=1` is Triton's own switch, read by triton itself when it compiles a
    kernel; it is not a setting of this project, so it is read here the way triton reads it
    (and not passed down from the entry point). The wrappers use it to choose tile sizes and
    fp32 dots, and `kernels.select` to refuse a backend that has nowhere to run.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


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
