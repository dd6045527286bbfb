"""DSpark rings: each sequence's per-stage key rings and the committed-row writes into them.

Owns `DraftState` (one ring [W, Dh] per stage, position q in slot q % W), the checks that a
ring set has the module's layout, and the commit path behind `DSparkDraft.write_main_kv` /
`write_main_kv_batch`: plan (argument checks, then one key per stage for every row still in
the window), check (finiteness, resent positions must give bitwise-equal keys), apply. A
write is computed one row at a time, so a ring never depends on which other commits shared
the call. It must not draft, load weights or decide which rows are committed (callers send
only accepted ones); the stage layers whose projections give the keys are
`dsv4.dspark_stage`'s, handed in by the module.

Dimension legend: R = committed rows in one write, T = len(dspark_target_layer_ids), D = dim,
Dh = head_dim, W = window_size, S = number of DSpark stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dsv4.config import ModelConfig
from dsv4.draft_args import check_commit
from dsv4.host_sync import host_copy


@dataclass
class DraftState:
    """One sequence's rings: rings[s] [W, Dh] (position q in slot q % W), and
    last_position, the last committed position written (-1: nothing yet)."""

    rings: list[torch.Tensor]
    last_position: int = -1

    def reset(self) -> None:
        """Zero every ring and forget the committed positions (the sequence starts over)."""
        for ring in self.rings:
            ring.zero_()
        self.last_position = -1

    @property
    def nbytes(self) -> int:
        """Bytes held by the rings (S * W * Dh * itemsize)."""
        return sum(r.nbytes for r in self.rings)


@dataclass(frozen=True)
class _Write:
    """A checked commit ready to land: todo (row index, position) pairs still inside the
    window, keys[j] one [Dh] key per stage for todo[j], finite[j] its on-device bool flags
    [1 + S] (`_row_keys`), last the last committed position after it."""

    todo: list[tuple[int, int]]
    keys: list[list[torch.Tensor]]
    finite: list[torch.Tensor]
    last: int


def new_rings(cfg: ModelConfig, stages: int, like: torch.Tensor) -> DraftState:
    """Empty rings (zeros): `stages` tensors [W, Dh] in `like`'s dtype and on its device."""
    return DraftState([torch.zeros(cfg.window_size, cfg.head_dim, dtype=like.dtype, device=like.device)
                       for _ in range(stages)])


def check_rings(cfg: ModelConfig, rings: object, stages: int, like: torch.Tensor) -> None:
    """`rings` must be `stages` tensors [W, Dh] in `like`'s dtype and on its device.

    Raises:
        ValueError: wrong container, count, shape, dtype or device (the ring and what it is named).
    """
    shape = (cfg.window_size, cfg.head_dim)
    if not isinstance(rings, (list, tuple)) or len(rings) != stages:
        got = len(rings) if isinstance(rings, (list, tuple)) else type(rings).__name__
        raise ValueError(f"state has {got} rings, the module {stages} stages: use module.new_state()")
    for s, r in enumerate(rings):
        if not torch.is_tensor(r) or tuple(r.shape) != shape or r.dtype != like.dtype or r.device != like.device:
            got = f"{tuple(r.shape)} {r.dtype} on {r.device}" if torch.is_tensor(r) else type(r).__name__
            raise ValueError(f"rings[{s}] is {got}, the module needs {shape} (window_size, head_dim) "
                             f"{like.dtype} on {like.device}: use module.new_state()")


def check_state(cfg: ModelConfig, state: object, stages: int, like: torch.Tensor) -> None:
    """`state` must be a `DraftState` whose rings pass `check_rings`. Raises ValueError otherwise."""
    if not isinstance(state, DraftState):
        raise ValueError(f"state must be a DraftState, got {type(state).__name__}: use module.new_state()")
    check_rings(cfg, state.rings, stages, like)


def write_commits(cfg: ModelConfig, stages: Sequence, like: torch.Tensor, states: Sequence[DraftState],
                  rows: Sequence[torch.Tensor], positions: Sequence[Sequence[int]]) -> list[ValueError | None]:
    """Write N commits (rows[i] [R_i, T*D] fp32/bf16 of positions[i] into states[i]), each
    checked and applied on its own; the rules are `DSparkDraft.write_main_kv`'s.

    stages: the module's DSpark stages (their main_proj / main_norm / attn.project_kv give the
    keys); like: a tensor in the rings' dtype and on their device. Returns one entry per
    commit: None when written, else the ValueError that rejected it (that state unchanged).
    Raises:
        ValueError: the three sequences of different lengths, or one state twice; nothing is
            written then.
    """
    if not len(states) == len(rows) == len(positions):
        raise ValueError(f"write_main_kv_batch: {len(states)} states, {len(rows)} row tensors and "
                         f"{len(positions)} position lists: need one of each per commit")
    if len({id(s) for s in states}) != len(states):
        raise ValueError("write_main_kv_batch: a state appears twice; a session commits at most once per batch")
    plans: list[_Write | ValueError] = []
    for state, r, pos in zip(states, rows, positions):
        try:
            plans.append(_plan_write(cfg, stages, like, state, r, pos))
        except ValueError as exc:
            plans.append(exc)
    flags = [f for plan in plans if isinstance(plan, _Write) for f in plan.finite]
    with host_copy():  # the step's one crossing: every commit's verdict in one read
        all_finite = bool(torch.stack(flags).all()) if flags else True
    errors: list[ValueError | None] = []
    for state, plan in zip(states, plans):
        error = plan if isinstance(plan, ValueError) else _check_write(cfg, state, plan, all_finite)
        if error is None:
            _apply_write(cfg, state, plan)
        errors.append(error)
    return errors


def _plan_write(cfg: ModelConfig, stages: Sequence, like: torch.Tensor, state: DraftState,
                rows: torch.Tensor, positions: Sequence[int]) -> _Write:
    """Check one commit's arguments and compute the keys of every row it may write (row by
    row, batch-size invariant). Raises ValueError (arguments); writes nothing."""
    check_state(cfg, state, len(stages), like)
    pos = check_commit(cfg, state.last_position, rows, positions)
    rows = rows.to(like.device, non_blocking=rows.is_pinned())  # pinned: one DMA, the host goes on
    last = max(state.last_position, pos[-1])
    todo = [(i, p) for i, p in enumerate(pos) if p > last - cfg.window_size]
    computed = [_row_keys(stages, rows[i:i + 1], p) for i, p in todo]
    return _Write(todo, [k for k, _ in computed], [ok for _, ok in computed], last)


def _check_write(cfg: ModelConfig, state: DraftState, plan: _Write, all_finite: bool) -> ValueError | None:
    """The key-level problems of a planned commit (`write_main_kv`'s), or None."""
    finite = torch.stack(plan.finite) if plan.finite and not all_finite else None  # [n, 1 + S]
    if finite is not None and not bool(finite.all()):
        j, s = (int(x) for x in (~finite).nonzero()[0])
        i, p = plan.todo[j]
        if s == 0:  # rsqrt(inf) = 0 in main_norm: a finite but huge row would give zero (or NaN) keys
            return ValueError(f"rows[{i}] (position {p}) is out of range: its main_proj output overflows "
                              f"main_norm's mean square (|x| up to ~1e19 in fp32)")
        return ValueError(f"rows[{i}] (position {p}) gives a non-finite key in stage {s - 1}")
    W = cfg.window_size
    for (i, p), keys in zip(plan.todo, plan.keys):
        if p <= state.last_position:  # still in the window, so slot p % W holds position p
            changed = [s for s, (k, ring) in enumerate(zip(keys, state.rings))
                       if not torch.equal(k.to(ring.dtype), ring[p % W])]
            if changed:
                return ValueError(f"position {p} is already committed with a different row: rows[{i}] "
                                  f"would change stage {changed[0]}'s key (committed positions may only "
                                  f"be resent with identical rows)")
    return None


def _apply_write(cfg: ModelConfig, state: DraftState, plan: _Write) -> None:
    """Land a checked plan: keys of positions past the last committed one go to slot p % W."""
    W = cfg.window_size
    for (_, p), keys in zip(plan.todo, plan.keys):
        if p > state.last_position:
            for ring, k in zip(state.rings, keys):
                ring[p % W] = k
    state.last_position = plan.last


def _row_keys(stages: Sequence, row: torch.Tensor, p: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Keys [Dh] of one committed row [1, T*D] at position p, one per stage, and on-device bool
    flags [1 + S]: main_norm's mean square is finite, then each stage's key is finite."""
    stage0 = stages[0]
    proj = stage0.main_proj(row)  # [1, D]
    mx = stage0.main_norm(proj)
    at = torch.tensor([p], device=mx.device)
    keys = [stage.attn.project_kv(mx, at)[0] for stage in stages]
    ok = [torch.isfinite(proj.float().square().mean())] + [torch.isfinite(k).all() for k in keys]
    return keys, torch.stack(ok)
