"""Where a verifier or drafter runs its model: the device setting, its checks, and the one
host crossing per reply.

Owns the check that a device exists (made at start-up, before any model loads), the default
dtype per device and the pinned host buffers that
hidden rows cross through once per reply, each way (docs/deployment.md §4). The spelling (`cpu`,
`cuda`, `cuda:N`) is `services.common.settings.parse_device`, so reading settings needs no
torch. It never moves a model: `services.app` passes the parsed device to the loaders.

Dtypes. A GPU computes in bf16 by default (the trunk's and the drafter's weights and
activations); what stays fp32 is decided by the model code, whatever this default: RMSNorm
statistics (a bf16 mean of squares loses the small rows' scale), the mHC mixing parameters,
the output head and its logits (the accept rule compares logits across paths and the
sampling filters soft-max them: bf16 logits would tie distinct tokens and move Gumbel-max
winners), and all of sampling (fp32 filters, fp64 noise; `dsv4.sampling`). A CPU stays fp32
by default: it is the test configuration, and CPU bf16 is slower, not faster.
"""

from __future__ import annotations

import torch


class DeviceUnavailable(RuntimeError):
    """The named device does not exist on this machine (one line naming it)."""


def check_available(device: str) -> torch.device:
    """The torch device for a parsed spelling, once it is known to exist.

    Raises:
        DeviceUnavailable: CUDA named on a machine without CUDA, or cuda:N with N at or past
            the device count (one line naming the device and what exists).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {device}: CUDA is not available on this machine (use --device cpu)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceUnavailable(f"device {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return dev


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 on a CPU (module docstring: what stays fp32 either way)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The reply's one device-to-host copy: t on any device -> the same values on the CPU.

    A CUDA tensor is copied into a pinned (page-locked) buffer, so the transfer is a single
    DMA without a staging copy; a CPU tensor is returned as is (no copy, nothing to pin).
    """
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t)


def to_pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host side of a reply's one host-to-device crossing (a drafter's commit rows):
    t (CPU) bound for `device` -> the same values in a pinned (page-locked) buffer when
    `device` is CUDA, so the copy onto it is a single DMA without a staging copy, issued with
    `non_blocking=True` (the step's kernels follow it on the same stream); t itself when
    `device` is the CPU (nothing crosses).
    """
    if device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
