"""Live oracle drafter: proposes the target's own greedy continuation of the committed tokens.

The service form of the oracle drafter (`dspark serve drafter --oracle`). It holds a copy of
the trunk, follows each session's committed tokens (`observe_tokens`, fed from the commit
messages' token ids) and drafts by greedy-decoding the anchor and the next block_size - 1
tokens on a copy of the session's target state. Every draft it makes is therefore what the
verifier would choose, except where the corruption schedule replaces a token by
(token + 1) % vocab_size: slot j of a draft at seed position p is corrupted when
`corrupt_every` > 0 and (p + j) % corrupt_every == corrupt_every - 1. Confidence logits are
`confident` for kept tokens and `doubtful` for corrupted ones, so a gated run can learn them.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dsv4.dspark import check_seed
from dsv4.trunk import Trunk, TrunkState
from services.drafter.engine import SessionTable, drafter_identity


@dataclass
class _LiveSession:
    state: TrunkState
    tokens: list[int] = field(default_factory=list)  # committed tokens fed to `state`
    last_position: int = -1  # last position whose row was committed
    lock: threading.Lock = field(default_factory=threading.Lock)


class LiveOracleDrafter:
    """Drafter-engine interface over a `Trunk` (see the module docstring).

    Raises:
        ValueError: corrupt_every < 0.
    """

    def __init__(self, trunk: Trunk, max_sessions: int = 16, corrupt_every: int = 0,
                 confident: float = 6.5, doubtful: float = -2.0):
        if corrupt_every < 0:
            raise ValueError(f"corrupt_every={corrupt_every}: must be >= 0")
        self.trunk, self.cfg = trunk, trunk.cfg
        self.corrupt_every, self.confident, self.doubtful = corrupt_every, confident, doubtful
        self._table = SessionTable(max_sessions)

    @property
    def max_sessions(self) -> int:
        return self._table.max_sessions

    @property
    def num_sessions(self) -> int:
        return len(self._table)

    def identity(self) -> dict:
        return drafter_identity(self.cfg, True, 1, "oracle")

    def open_session(self) -> int:
        return self._table.open(_LiveSession(self.trunk.new_state()))

    def close_session(self, sid: int) -> None:
        self._table.close(sid)

    def observe_tokens(self, sid: int, first_position: int, token_ids: Sequence[int]) -> None:
        """Feed committed tokens of positions first_position.. (the prompt first, then each round's).

        Raises:
            ValueError: the tokens do not continue the ones already seen.
        """
        s = self._table.get(sid)
        with s.lock:
            if first_position != len(s.tokens):
                raise ValueError(f"oracle: token_first_position={first_position} does not continue the "
                                 f"{len(s.tokens)} committed tokens seen")
            ids = [int(t) for t in token_ids]
            if not s.tokens:
                self.trunk.prefill(s.state, torch.tensor(ids), taps=False)
            else:
                for i, t in enumerate(ids):
                    self.trunk.decode(s.state, t, first_position + i, taps=False)
            s.tokens += ids

    def commit(self, sid: int, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Rows are not used; after the first (priming) commit, positions must continue (or repeat)
        the committed ones."""
        s = self._table.get(sid)
        positions = list(positions)
        with s.lock:
            if positions and s.last_position >= 0 and positions[0] > s.last_position + 1:
                raise ValueError(f"commit positions start at {positions[0]}, after the last committed "
                                 f"position {s.last_position}: a gap")
            if positions:
                s.last_position = max(s.last_position, positions[-1])

    def draft(self, sid: int, anchor: int, seed_position: int) -> tuple[list[int], torch.Tensor]:
        """Greedy continuation of [committed tokens, anchor], corrupted by the schedule.

        Raises:
            ValueError: seed_position is not the last committed position (both named), or the
                committed tokens are not known up to it.
        """
        s = self._table.get(sid)
        with s.lock:
            check_seed(s.last_position, seed_position)
            if len(s.tokens) != seed_position + 1:
                raise ValueError(f"oracle: knows {len(s.tokens)} committed tokens, seed position "
                                 f"{seed_position} needs {seed_position + 1}")
            state = copy.deepcopy(s.state)
        B, V = self.cfg.dspark_block_size, self.cfg.vocab_size
        tokens, conf, token = [], [], int(anchor)
        for j in range(B):
            pos = seed_position + 1 + j
            if pos >= self.cfg.max_seq_len:
                break
            token = int(self.trunk.decode(state, token, pos, taps=False).logits.argmax())
            bad = self.corrupt_every > 0 and (seed_position + j) % self.corrupt_every == self.corrupt_every - 1
            tokens.append((token + 1) % V if bad else token)
            conf.append(self.doubtful if bad else self.confident)
        while len(tokens) < B:  # past max_seq_len: filler the verifier never receives
            tokens.append(0)
            conf.append(self.doubtful)
        return tokens, torch.tensor(conf)
