"""Argument checks shared by the DSpark draft module (`dsv4.dspark`) and the drafter
engines/oracles (`services.drafter`): commits, seeds, draft arguments, draft length, integer
lists (each element by `dsv4.scalars.as_int`) and weight problems. This module owns those checks and their ValueErrors, which
name the bad value; it runs no model math and holds no state."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from dsv4.config import ModelConfig
from dsv4.scalars import as_int, short_repr

ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the wire carries; fp16/fp64 rows are rejected


def check_commit(cfg: ModelConfig, last_position: int, rows: torch.Tensor, positions: Sequence[int]) -> list[int]:
    """Validate one commit (see `DSparkDraft.write_main_kv`); returns the positions as ints.

    rows: a [R, T*D] torch.float32 or torch.bfloat16 tensor (the dtypes the wire carries;
    fp16 and fp64 are rejected rather than silently rounded or widened). positions: R
    integers (int, numpy or torch integer, not bool); a float such as 11.5 is an error, never
    truncated. last_position: the sequence's last committed position (-1: nothing yet).
    Raises:
        ValueError: naming the bad value (see `write_main_kv`).
    """
    if not torch.is_tensor(rows):
        raise ValueError(f"rows must be a torch tensor [R, {cfg.tap_width}], got {type(rows).__name__}")
    if rows.ndim != 2:
        raise ValueError(f"rows must be a 2-D tensor [R, {cfg.tap_width}], got shape {tuple(rows.shape)}")
    if rows.dtype not in ROW_DTYPES:
        raise ValueError(f"rows dtype {rows.dtype}: must be torch.float32 or torch.bfloat16")
    if rows.shape[1] != cfg.tap_width:
        raise ValueError(f"row width {rows.shape[1]} != tap width {cfg.tap_width} "
                         f"({len(cfg.dspark_target_layer_ids)} target layers x dim {cfg.dim})")
    pos = as_int_list("positions", positions, expect_len=rows.shape[0], what="rows")
    if any(b != a + 1 for a, b in zip(pos, pos[1:])):
        raise ValueError(f"positions {pos[0]}..{pos[-1]} are not consecutive ascending: {short_repr(pos)}")
    if pos[0] < 0 or pos[-1] >= cfg.max_seq_len:
        raise ValueError(f"positions {pos[0]}..{pos[-1]} outside [0, max_seq_len={cfg.max_seq_len})")
    bad = (~torch.isfinite(rows)).any(dim=1).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"rows[{i}] (position {pos[i]}) contains NaN or Inf")
    if last_position < 0 and pos[0] > 0 and len(pos) < cfg.window_size:
        raise ValueError(f"first write starts at position {pos[0]} with {len(pos)} rows: it must start "
                         f"at 0 or hold >= window_size={cfg.window_size} rows")
    if last_position >= 0 and pos[0] > last_position + 1:
        raise ValueError(f"positions start at {pos[0]} but the last committed position is {last_position}: "
                         f"gap of {pos[0] - last_position - 1}")
    return pos


def check_seed(last_position: int, seed_position: int) -> None:
    """A draft's seed position must be the last committed position (docs/model.md §9.2).

    Raises:
        ValueError: nothing committed yet, or seed_position != last_position (both named).
    """
    if last_position < 0:
        raise ValueError("nothing committed yet: write the prompt's rows before drafting")
    if seed_position != last_position:
        raise ValueError(f"seed_position={seed_position} is not the last committed position "
                         f"{last_position} (the anchor is roped at seed_position + 1)")


def check_draft_args(cfg: ModelConfig, anchor: Any, seed_position: Any) -> tuple[int, int]:
    """(anchor, seed_position) as ints. Raises ValueError naming the value unless both are
    integers (see `as_int`), 0 <= anchor < vocab_size and seed_position >= 0."""
    anchor, p = as_int("anchor", anchor), as_int("seed_position", seed_position)
    if not 0 <= anchor < cfg.vocab_size:
        raise ValueError(f"anchor={anchor} outside [0, vocab_size={cfg.vocab_size})")
    if p < 0:
        raise ValueError(f"seed_position={p}: must be >= 0")
    return anchor, p


def draft_length(cfg: ModelConfig, seed_position: int) -> int:
    """Drafts a round at seed position p returns: those of positions p+2.. before max_seq_len,
    min(B, max_seq_len - p - 2) (0 when the anchor is the last position). The one rule of the
    DSpark engine and both oracles; the gateway caps k by the same room (and keeps the bonus
    token inside the sequence), so it never submits a missing draft.

    Raises:
        ValueError: no room for the anchor (seed_position + 1 >= max_seq_len).
    """
    if seed_position + 1 >= cfg.max_seq_len:
        raise ValueError(f"seed_position={seed_position}: no room for the anchor at {seed_position + 1}, "
                         f"it must lie before max_seq_len={cfg.max_seq_len}")
    return min(cfg.dspark_block_size, cfg.max_seq_len - seed_position - 2)


def as_int_list(name: str, values: Any, expect_len: int | None = None, what: str = "") -> list[int]:
    """`values` (a range, list, tuple, numpy array or 1-D torch integer tensor) as a non-empty
    list of ints, each checked by `as_int`; `expect_len`: the number of `what` it must match.
    The length is checked before the elements are read. Raises ValueError naming the value."""
    if torch.is_tensor(values):
        if values.ndim != 1 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"{name}={short_repr(values)} ({values.dtype}, shape {tuple(values.shape)}): "
                             f"must be a 1-D integer tensor or a sequence of integers")
        values = values.tolist()
    elif isinstance(values, (str, bytes, Mapping)) or not (hasattr(values, "__len__") and hasattr(values, "__iter__")):
        raise ValueError(f"{name}={short_repr(values)} ({type(values).__name__}): must be a sequence of integers")
    if expect_len is not None and len(values) != expect_len:
        raise ValueError(f"{expect_len} {what} but {len(values)} {name} (need as many, >= 1)")
    if len(values) == 0:
        raise ValueError(f"{name} is empty: need at least one")
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def weight_problem(name: str, t: Any) -> str:
    """What is wrong with one weight value ("" if nothing)."""
    if not torch.is_tensor(t):
        return f"{name}: {type(t).__name__} is not a torch tensor"
    if not t.is_floating_point():
        return f"{name}: dtype {t.dtype} is not floating point"
    return "" if bool(torch.isfinite(t).all()) else f"{name}: contains NaN or Inf"


def listed(items: list[str], limit: int = 8) -> str:
    more = f"; (and {len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more
