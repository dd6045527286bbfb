"""The host-sync discipline of a step, checked at run time on any device.

A step (one `Trunk.forward_batch`, one `DSparkDraft.draft_batch` or `write_main_kv_batch`)
must queue its work on the model's device and never wait for it: on a GPU every `.item()`,
`.tolist()`, `.cpu()`, `.numpy()` or Python branch on a device value (`if t:`, `int(t)`,
`float(t)`, a tensor used as a list index) blocks the host until the device has drained,
which serialises the host's scheduling with the device's compute. On a CPU such code costs
nothing and so hides the same design error; this module catches it there too.

`no_host_sync()` runs a block under a torch function mode that raises `HostSyncError` on any
of those calls, naming it; `host_copy()` marks the step's one allowed crossing (the tokens or
rows of the reply) inside such a block. Both are thread-local, as torch's function modes
are: they guard the thread that runs the step. Where CUDA exists the same steps also run
under `torch.cuda.set_sync_debug_mode("error")` (tests/test_host_sync.py), which catches
what the device itself sees as a synchronisation.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that read a device value on the host (each a device synchronisation on a GPU).
SYNC_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                          "nonzero", "unique", "masked_select"})
_state = threading.local()
# The host syncs the step path still makes, each for a reason; a checker run lets these sites
# through and fails on any other. The MoE loops are the torch path's expert dispatch: they
# visit only the experts a step routed to, which the host must know to slice the weights; a
# grouped-GEMM kernel that takes the routing on the device removes them.
KNOWN_STEP_SYNCS = {
    "dsv4/moe.py:combine": "the trunk's routed experts: the expert ids a step routes to, read to loop over them",
    "dsv4/dspark_stage.py:routed": "the drafter's routed experts: as the trunk's",
    "dsv4/draft_args.py:check_commit": "the finiteness check of committed rows: host rows from the wire, "
                                       "checked before they cross to the device (no device sync on a GPU)",
}


class HostSyncError(RuntimeError):
    """A step read a device value on the host outside its one allowed copy (the call named)."""


class _Guard(TorchFunctionMode):
    """Raises HostSyncError on SYNC_METHODS and on `.to()` of a tensor towards the CPU from
    another device, unless `host_copy()` is active on this thread or the call comes from a
    site in `allowed` ("dsv4/moe.py:combine": a path suffix and a function name); with
    `found` a list, appends each sync site there instead of raising."""

    def __init__(self, allowed: frozenset[str], found: list[str] | None):
        super().__init__()
        self.allowed, self.found = allowed, found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_state, "allowed", 0):
            name = getattr(func, "__name__", "")
            if name in SYNC_METHODS or (name == "to" and _to_host(args, kwargs)):
                self._refuse(name)
        return func(*args, **kwargs)

    def _refuse(self, name: str) -> None:
        site = _caller_site()
        if site.split(" ")[0] in self.allowed:
            return
        if self.found is not None:
            self.found.append(f"{site}: Tensor.{name}()")
            return
        raise HostSyncError(f"host sync in a step at {site}: Tensor.{name}() reads a device value on the host")


def _caller_site() -> str:
    """"path:function line N" of the nearest frame outside torch and this module, the path
    relative to the repository root."""
    root = Path(__file__).resolve().parents[1]
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != Path(__file__).resolve() and root in path.parents and ".venv" not in path.parts:
            return f"{path.relative_to(root).as_posix()}:{frame.f_code.co_name} line {frame.f_lineno}"
        frame = frame.f_back
    return "<outside the repository>"


def _to_host(args, kwargs) -> bool:
    """Whether a `.to(...)` call moves a non-CPU tensor to the CPU."""
    src = args[0] if args and torch.is_tensor(args[0]) else None
    if src is None or src.device.type == "cpu":
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


@contextlib.contextmanager
def no_host_sync(allowed: frozenset[str] = frozenset(), found: list[str] | None = None) -> Iterator[None]:
    """Run the block with host syncs forbidden on this thread: HostSyncError at the first one,
    naming the call and its site ("path:function line N"). allowed: sites let through
    ("dsv4/moe.py:combine"); found: a list to append every sync site to instead of raising
    (a survey)."""
    with _Guard(allowed, found):
        yield


@contextlib.contextmanager
def host_copy() -> Iterator[None]:
    """The step's one allowed device-to-host crossing (the reply's tokens or rows): inside a
    `no_host_sync` block, lets the calls of this block through. Free outside one."""
    _state.allowed = getattr(_state, "allowed", 0) + 1
    try:
        yield
    finally:
        _state.allowed -= 1
