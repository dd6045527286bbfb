"""`DSPARK_TOPK_DIAG=K`: the verifier's trunk writes the top-K ids and logits of every forward (for `dspark parity`).

Owns the dump file format and its writing; the wrapper never changes a result of the trunk it
wraps, and it reads no environment (K and the folder arrive as `TopKDiagSettings`).

`maybe_wrap(model, setting, rank)` returns `model` unchanged when `setting` is None (what
`services.settings` makes of `DSPARK_TOPK_DIAG` unset or 0); for K >= 1 it returns a
`TopKDiagTrunk` that forwards every call to the model and, after each
prefill (or prompt chunk), decode and verify block, appends one JSON line to
`$DSPARK_TOPK_DIAG_DIR/topk-rank{rank}-pid{pid}.jsonl` (default directory: the working one;
a second wrapped trunk in the same process writes `...-pid{pid}-1.jsonl`, and so on).
The verifier wraps its trunk with it (`services.app.verifier_engine`), and under tensor
parallelism every rank wraps its own shard (`services.verifier.tp`), so each rank writes its
own file.

File format (one JSON object per line):
  header  {"format": "dspark-topk", "version": 1, "k": K, "rank": r, "pid": p, "config_hash": h}
  forward {"session": s, "op": "prefill" | "decode" | "block", "positions": [q...],
           "tokens": [input token at each q], "ids": [[K ids] per q], "logits": [[K logits] per q]}
          with, for "prefill", "prompt_len" and "prompt_sha256" (of the ids, little-endian int64).
`session` numbers the states in the order of their prefill within the process (0, 1, ...).
A prefill records only its last position (the trunk returns only that row's logits); a
prompt fed in chunks by the step loop records each chunk's last position, the last chunk
with the whole prompt's length and hash (what `dspark parity` pairs sessions by); a
verify block records every forwarded position, rejected ones included: a later forward of
the same position (after the rollback) supersedes it. Writing syncs the device once per
forward, so this is for diagnosis, never for serving speed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ENV_K = "DSPARK_TOPK_DIAG"
ENV_DIR = "DSPARK_TOPK_DIAG_DIR"  # named in errors about the dump folder
FORMAT = "dspark-topk"
MAX_K = 4096
_WRAPPED = itertools.count()


@dataclass(frozen=True)
class TopKDiagSettings:
    """Dump the top `k` ids and logits of every forward into files in `folder`.

    Raises:
        ValueError: k not an integer in [1, MAX_K], or folder not an existing directory (named).
    """

    k: int
    folder: Path = Path(".")

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise ValueError(f"top-k k={self.k!r}: must be an integer in [1, {MAX_K}]")
        if not Path(self.folder).is_dir():
            raise ValueError(f"top-k folder={str(self.folder)!r}: not an existing directory")


def maybe_wrap(model, setting: TopKDiagSettings | None, rank: int = 0):
    """`model`, wrapped in a `TopKDiagTrunk` when `setting` asks for dumps (module docstring);
    `model` itself when `setting` is None.

    Raises ValueError naming the folder's variable and value when a dump file cannot be created
    there (read-only, no permission).
    """
    if setting is None:
        return model
    folder = Path(setting.folder)
    n = next(_WRAPPED)  # a second wrapped trunk in one process (tests) gets its own file
    suffix = "" if n == 0 else f"-{n}"
    path = folder / f"topk-rank{rank}-pid{os.getpid()}{suffix}.jsonl"
    try:
        return TopKDiagTrunk(model, setting.k, path, rank)
    except OSError as exc:
        raise ValueError(f"{ENV_DIR}={str(folder)!r}: cannot create the dump {path.name}: "
                         f"{exc.strerror or exc}") from None


def _sha256(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


def _ids(token_ids: Any) -> list[int]:
    """Token ids (one id, a sequence or a tensor of them) as a list of ints."""
    return [int(t) for t in torch.as_tensor(token_ids).reshape(-1).tolist()]


class TopKDiagTrunk:
    """A Trunk proxy that dumps top-K logits per forward; every other attribute is the model's."""

    def __init__(self, model, k: int, path: Path, rank: int = 0):
        self.model, self.k, self.path, self.rank = model, k, Path(path), rank
        self._lock = threading.Lock()
        self._sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._prompts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> prompt ids so far
        self._next = itertools.count()
        self._file = open(self.path, "a", encoding="utf-8")
        cfg = getattr(model, "cfg", None)
        header = {"format": FORMAT, "version": 1, "k": k, "rank": rank, "pid": os.getpid(),
                  "config_hash": cfg.config_hash() if cfg is not None else None}
        self._emit(header)

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def _emit(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def _record(self, state, op: str, positions: list[int], tokens: list[int], logits: torch.Tensor,
                **extra) -> None:
        k = min(self.k, logits.shape[-1])
        top = torch.topk(logits.detach().float().reshape(len(positions), -1), k, dim=-1)  # [R, K]
        session = self._sessions.get(state, -1)
        self._emit({"session": session, "op": op, "positions": positions, "tokens": tokens,
                    "ids": top.indices.cpu().tolist(), "logits": top.values.cpu().tolist(), **extra})

    def prefill(self, state, token_ids, keep_rows=None, taps=True):
        out = self.model.prefill(state, token_ids, keep_rows=keep_rows, taps=taps)
        ids = _ids(token_ids)
        with self._lock:
            self._sessions[state] = next(self._next)
        self._record(state, "prefill", [len(ids) - 1], [ids[-1]], out.logits, prompt_len=len(ids),
                     prompt_sha256=_sha256(ids))
        return out

    def decode(self, state, token_id, position, taps=True):
        out = self.model.decode(state, token_id, position, taps=taps)
        self._record(state, "decode", [int(position)], [int(token_id)], out.logits)
        return out

    def forward_block(self, state, token_ids, start_pos):
        out = self.model.forward_block(state, token_ids, start_pos)
        ids = _ids(token_ids)
        self._record(state, "block", list(range(int(start_pos), int(start_pos) + len(ids))), ids, out.logits)
        return out

    def forward_batch(self, items):
        """`forward_batch` of the model, then one record per item in order: a decode's
        ("decode"), a verify block's ("block", every position), or a prompt chunk's ("prefill",
        its last position, with the length and hash of the prompt forwarded so far: a chunk
        from position 0 starts a session's numbering, the prompt's last chunk carries the whole
        prompt)."""
        outs = self.model.forward_batch(items)
        for item, out in zip(items, outs):
            ids, start = _ids(item.tokens), int(item.start_pos)
            positions = list(range(start, start + len(ids)))
            if item.prefill:
                with self._lock:
                    if start == 0:
                        self._sessions[item.state] = next(self._next)
                        self._prompts[item.state] = []
                    prompt = self._prompts.setdefault(item.state, [])
                    prompt += ids
                    prompt = list(prompt)
                self._record(item.state, "prefill", positions[-1:], ids[-1:], out.logits, prompt_len=len(prompt),
                             prompt_sha256=_sha256(prompt))
            else:
                self._record(item.state, "block" if item.verify else "decode", positions, ids, out.logits)
        return outs

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
