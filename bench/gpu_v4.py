"""The V4-Flash-shaped stage of `python -m bench.gpu_check --services`: the three services on a
random checkpoint with DeepSeek-V4-Flash's real sizes and formats, as many trunk layers as fit.

Owns the shape of that checkpoint, its device-memory budget and the stage itself; the random
values and the folder are `dsv4.random_checkpoint`'s, the services' checks `bench.gpu_services`'.

Shape (`flash_shaped`): `ModelConfig()`'s defaults are V4-Flash's (`dsv4.config`: hidden 4096,
64 heads of 512, q/o low ranks 1024, 8 output groups, window 128, indexer 64 heads of 128 top
512, 256 routed experts of 2048 with 6 active + 1 shared, vocab 129,280, fp8 dense weights and
fp4 routed experts, quantisation simulation on, as the 0731 checkpoint runs), with its 3 DSpark
stages, and the trunk cut to `n_layers`: its layers are Flash's from layer 2 on (ratio 4 with the
indexer and hash routing, then 128, 4, 128 ... scored), the drafter taps the last (up to) three
(Flash: 40, 41, 42, so `main_proj` reads 1..3 taps instead of 3). `max_seq_len` is 4096: the
check's generations are short and per-session caches are sized by it.

Budget (`fit_layers`). On a GPU each process holds its model in bf16 (the loader decodes the
fp8 / fp4 bytes; norms, mHC, gates and the drafter's head stay fp32: `services.common.device`),
measured by building the modules on the meta device: the drafter 42.98 GB, the trunk 3.1 GB plus
13.2 GB per layer (256 experts x 3 x 2048 x 4096 bf16 = 12.9 GB of it). Loading streams one
decoded tensor at a time into the module (`Trunk.load_streamed`), so the load peak is the model
plus its largest tensor (the 1.06 GB embedding), not twice the model. With `RESERVE_BYTES` per
process (CUDA context, allocator slack, that tensor, sessions' caches) the stage fits in
`BUDGET_BYTES` = 70 GB with 1 trunk layer: 16.3 + 43.0 + 2 x 2 = 63.3 GB; 2 layers need 76.5.
The dry run uses `toy_shaped`: the same structure (1 layer of ratio 4 with hash routing, fp8
and fp4 storage, quantisation simulation, 3 stages) at the tiny test dimensions, through the
same code path on the CPU.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch

from bench.gpu_services import Prefixed, device_for, run_stack
from bench.service_procs import StackSpec
from dsv4.config import ModelConfig, tiny_config
from dsv4.random_checkpoint import write_random_checkpoint

BUDGET_BYTES = 70 * 10**9  # the budget for trunk + drafter on one 80 GB GPU
RESERVE_BYTES = 2 * 10**9  # per process: CUDA context, allocator slack, one decoded tensor, caches
FLASH_FIRST_LAYER = 2  # Flash's layers 0-1 are sliding-window only; 2 is the first compressed one
SEED = 0
MARKER = "random_checkpoint.json"  # written last: the folder is complete and of this config


def flash_shaped(n_layers: int) -> ModelConfig:
    """V4-Flash's configuration with `n_layers` trunk layers (module docstring).

    Raises:
        ValueError: n_layers outside 1 .. 41 (Flash's 43 less the two it skips).
    """
    flash = ModelConfig()
    if not 1 <= n_layers <= flash.n_layers - FLASH_FIRST_LAYER:
        raise ValueError(f"n_layers={n_layers}: must lie in [1, {flash.n_layers - FLASH_FIRST_LAYER}]")
    ratios = flash.compress_ratios[FLASH_FIRST_LAYER:FLASH_FIRST_LAYER + n_layers]
    hashed = max(0, flash.n_hash_layers - FLASH_FIRST_LAYER)
    return flash.replace(n_layers=n_layers, compress_ratios=ratios + (0,) * flash.n_mtp_layers,
                         n_hash_layers=min(hashed, n_layers), quant_sim=True, max_seq_len=4096,
                         dspark_target_layer_ids=tuple(range(max(0, n_layers - 3), n_layers)))


def toy_shaped() -> ModelConfig:
    """The dry run's stand-in: `flash_shaped(1)`'s structure at the tiny test dimensions."""
    return tiny_config(n_layers=1, compress_ratios=[4, 0, 0, 0], n_hash_layers=1, dspark_target_layer_ids=[0],
                       weight_dtype="fp8", expert_dtype="fp4", quant_sim=True, max_seq_len=256)


def device_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(trunk, drafter) bytes of parameters and buffers at `dtype`, from modules built on the
    meta device (nothing allocated; a few seconds at V4-Flash sizes)."""
    from dsv4.dspark import DSparkDraft
    from dsv4.trunk import Trunk

    def size(m: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))

    return size(Trunk(cfg, dtype=dtype, device="meta")), size(DSparkDraft(cfg, dtype=dtype, device="meta"))


def fit_layers(budget: int = BUDGET_BYTES, reserve: int = RESERVE_BYTES) -> tuple[int, int, int]:
    """The most trunk layers whose trunk, beside the drafter, fits `budget` bytes with
    `reserve` per process: (layers, trunk bytes, drafter bytes).

    Raises:
        ValueError: not even one layer fits (the bytes named).
    """
    best = None
    for n in range(1, ModelConfig().n_layers - FLASH_FIRST_LAYER + 1):
        trunk, drafter = device_bytes(flash_shaped(n))
        if trunk + drafter + 2 * reserve > budget:
            break
        best = (n, trunk, drafter)
    if best is None:
        raise ValueError(f"one layer needs {(trunk + drafter + 2 * reserve) / 1e9:.1f} GB, over the "
                         f"{budget / 1e9:.0f} GB budget")
    return best


def ensure_checkpoint(folder: Path, cfg: ModelConfig) -> tuple[int, bool]:
    """`folder` holds the random checkpoint of `cfg` (written unless a complete one is there):
    (bytes of tensor data, whether it was written now)."""
    marker = folder / MARKER
    want = {"config_hash": cfg.config_hash(), "seed": SEED}
    if marker.is_file():
        have = json.loads(marker.read_text())
        if {k: have.get(k) for k in want} == want:
            return have["bytes"], False
    marker.unlink(missing_ok=True)
    total = write_random_checkpoint(folder, cfg, SEED)
    marker.write_text(json.dumps({**want, "bytes": total}) + "\n")
    return total, True


def check_v4(rep, dry_run: bool, port_base: int, log_dir: Path, work_dir: Path, out: Path) -> None:
    """The stage: the budget, the checkpoint, then the services' sections on it (prompts off /
    always / gated == plain, 1 and 4 streams, the step tables written to `out`)."""

    if dry_run:
        cfg, note = toy_shaped(), "toy dimensions (dry run)"
    else:
        n, trunk, drafter = fit_layers()
        cfg = flash_shaped(n)
        note = (f"{n} layer(s): trunk {trunk / 1e9:.1f} + drafter {drafter / 1e9:.1f} + "
                f"{2 * RESERVE_BYTES / 1e9:.0f} reserve GB <= {BUDGET_BYTES / 1e9:.0f} GB")
    rep.info("V4: shape", f"dim {cfg.dim}, {cfg.n_heads} heads, {cfg.n_routed_experts} experts, ratios "
             f"{list(cfg.compress_ratios[:cfg.n_layers])}, {cfg.weight_dtype}/{cfg.expert_dtype}; {note}")
    t0 = time.perf_counter()
    total, written = ensure_checkpoint(work_dir, cfg)
    rep.info("V4: random checkpoint", f"{total / 1e9:.2f} GB {'written' if written else 'reused'} in "
             f"{time.perf_counter() - t0:.1f} s")
    env = (("DSPARK_DEVICE", device_for(dry_run)), ("DSPARK_STEP_PROFILE", "0" if dry_run else "1"))
    spec = StackSpec(checkpoint=str(work_dir), port_base=port_base, log_dir=log_dir, verify_numerics="exact",
                     max_sessions=16, env=env)
    max_tokens = 4 if dry_run else 16
    tables = asyncio.run(run_stack(spec, Prefixed(rep, "V4: "), [1] if dry_run else [1, 4], max_tokens))
    name = "cpu (dry run)" if dry_run else torch.cuda.get_device_name(0)
    out.write_text(json.dumps({"device": name, "model": f"v4-flash-shaped-{cfg.n_layers}L", **tables}, indent=1) + "\n")
    rep.info("V4: step-table file", str(out))
