"""Arms, loads and figures of `dspark simulate` (docs/simulate.md §4-5).

A cell is one arm at one load: `simulate_cell` builds its generations (closed loop: N streams,
each running `per_stream` generations back to back; open loop: Poisson arrivals at a rate),
runs a fresh simulated gateway and folds the traces into the serving benchmark's own figures
(`services.analysis.serving_stats.cell_figures`) plus the simulator's counters. Every random
draw comes from one `numpy.random.Generator` seeded per cell from `--seed`, the arm's
independent part excluded, so every arm of a cell sees the same prompts, lengths and rounds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from services.analysis.serving_stats import cell_figures
from services.gateway.rounds import Round, RoundLog
from services.simulate.engine import Arm, Gateway, RecordedText, RunConfig, StreamSpec
from services.simulate.models import ServiceModel

# The slowest open-loop arrival rate (generations per second): one every ~17 minutes. Slower
# arrivals put a cell's virtual clock where its figures (tokens per s, rounded to 1e-6) read 0
# and, below ~1e-305 per s, where the arrival gaps overflow to inf.
MIN_RATE = 1e-3


def arm_registry(block_size: int) -> dict[str, Arm]:
    """The arms by name: plain, k1..k<block>, gated (as served: the gate alone, the model
    regime with others in flight, docs/gate.md §14), gate-only (the gate alone), budget-trim
    (the gate's length, cut further by the verifier's step budget) and budget (the gate's
    pre-draft decision, the step budget choosing every length)."""
    arms = {"plain": Arm("plain", "off")}
    arms.update({f"k{k}": Arm(f"k{k}", "always", max_drafts=k) for k in range(1, block_size + 1)})
    arms["gated"] = Arm("gated", "gated", regime=True)
    arms["gate-only"] = Arm("gate-only", "gated")
    arms["budget-trim"] = Arm("budget-trim", "gated", budget="trim")
    arms["budget"] = Arm("budget", "gated", budget="full")
    return arms


@dataclass(frozen=True)
class Lengths:
    """A token length: fixed (`low == high`) or uniform over [low, high]. Parsed from "N" or
    "uniform:A:B" by `parse_lengths`."""

    low: int
    high: int

    def draw(self, rng: np.random.Generator, workload: str | None = None) -> int:
        """A length (tokens) for a generation of `workload` (the same rule for every one)."""
        return self.low if self.low == self.high else int(rng.integers(self.low, self.high + 1))

    def missing(self, names: Iterable[str]) -> list[str]:
        """The workloads of `names` without a length: none (one rule for all)."""
        return []

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True)
class WorkloadLengths:
    """A length per workload, e.g. each bench prompt's own token count. Parsed from
    "NAME=SPEC,NAME=SPEC..." (each SPEC "N" or "uniform:A:B") by `parse_lengths`."""

    lengths: tuple[tuple[str, Lengths], ...]

    def draw(self, rng: np.random.Generator, workload: str | None = None) -> int:
        """A length (tokens) for a generation of `workload`. Raises KeyError for a workload
        without one (`missing` names them before a run)."""
        return dict(self.lengths)[workload].draw(rng)

    def missing(self, names: Iterable[str]) -> list[str]:
        """The workloads of `names` this gives no length, in their order."""
        have = dict(self.lengths)
        return [n for n in names if n not in have]

    def __str__(self) -> str:
        return ",".join(f"{name}={spec}" for name, spec in self.lengths)


def parse_lengths(text: str, flag: str) -> Lengths | WorkloadLengths:
    """"N" or "uniform:A:B" (integers >= 1, A <= B), or one of those per workload:
    "NAME=SPEC,NAME=SPEC...". Raises ValueError naming the flag and value."""
    if "=" in text:
        pairs = [part.partition("=") for part in text.split(",")]
        if any(not name.strip() for name, _, _ in pairs) or len({n.strip() for n, _, _ in pairs}) < len(pairs):
            raise ValueError(f"{flag}={text!r}: must be NAME=SPEC,NAME=SPEC... with distinct workload names")
        return WorkloadLengths(tuple((name.strip(), parse_lengths(spec, f"{flag} {name.strip()}"))
                                     for name, _, spec in pairs))
    m = re.fullmatch(r"(\d+)|uniform:(\d+):(\d+)", text.strip())
    if m is None:
        raise ValueError(f"{flag}={text!r}: must be N, uniform:A:B (integers >= 1) or NAME=SPEC,...")
    low, high = (int(m.group(1)),) * 2 if m.group(1) else (int(m.group(2)), int(m.group(3)))
    if low < 1 or high < low:
        raise ValueError(f"{flag}={text!r}: needs 1 <= A <= B")
    return Lengths(low, high)


ORDERS = ("random", "cycle")  # which workload each generation replays (`stream_specs`)


@dataclass(frozen=True)
class Load:
    """Closed loop (`streams` streams, `per_stream` generations each, back to back) when rate
    is None, else open loop: `requests` generations arriving as a Poisson process at `rate`
    per second. Raises ValueError naming the value on streams < 1, a rate that is not finite
    or below MIN_RATE, or requests < 1."""

    streams: int = 1
    per_stream: int = 1
    rate: float | None = None
    requests: int = 64

    def __post_init__(self) -> None:
        if self.rate is None and (self.streams < 1 or self.per_stream < 1):
            raise ValueError(f"streams={self.streams}, per_stream={self.per_stream}: must be >= 1")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate >= MIN_RATE):
            raise ValueError(f"--rate {self.rate!r}: must be a finite number of requests per second "
                             f">= {MIN_RATE:g}")
        if self.rate is not None and self.requests < 1:
            raise ValueError(f"requests={self.requests}: must be >= 1")

    @property
    def label(self) -> str:
        return f"{self.rate:g}/s" if self.rate is not None else str(self.streams)


def workloads(logs: list[RoundLog], only: str | None = None) -> dict[str, list[Round]]:
    """The rounds of each workload of `logs` that holds a drafted round (one with
    confidences), in file order, the rounds that did not draft included (each moved the text
    on by one token); `only`: just that workload. Raises ValueError when `only` names no
    workload of the rounds, or nothing is left to replay."""
    out: dict[str, list[Round]] = {}
    known = sorted({r.workload for log in logs for r in log.rounds})
    if only is not None and only not in known:
        raise ValueError(f"--workload {only!r}: unknown; the rounds hold {', '.join(known)}")
    for log in logs:
        for r in log.rounds:
            if only is None or r.workload == only:
                out.setdefault(r.workload, []).append(r)
    out = {name: rounds for name, rounds in out.items() if any(r.confidence_logits for r in rounds)}
    if not out:
        what = f"workload {only!r}" if only is not None else "the rounds file(s)"
        raise ValueError(f"{what}: no drafted round (with confidence_logits) to replay")
    return out


def stream_specs(load: Load, groups: dict[str, list[Round]], prompt: Lengths | WorkloadLengths,
                 output: Lengths | WorkloadLengths, seed: int, order: str = "random") -> list[StreamSpec]:
    """The generations of one cell (module docstring): the first of each stream (closed loop,
    later ones chained with `then`) or every arrival (open loop), each with its lengths.

    order "random": each generation draws its workload and the drafted round it starts at.
    order "cycle": bench_serving's streams: closed loop, stream s's generation j replays
    workload (s * per_stream + j) mod W, open loop arrival i workload i mod W, the W workloads
    in the order the rounds files hold them, each from its first drafted round (the
    recording of that prompt's generation from its start, docs/simulate.md §5).

    Raises ValueError naming an unknown order.
    """
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: must be one of {', '.join(ORDERS)}")
    rng = np.random.default_rng([seed, load.streams, load.per_stream, 0 if load.rate is None else 1])
    names, in_file = sorted(groups), list(groups)
    texts = {name: RecordedText(groups[name]) for name in names}

    def spec(stream: int, arrival: float, index: int) -> StreamSpec:
        if order == "cycle":
            name = in_file[index % len(in_file)]
            return StreamSpec(stream, arrival, prompt.draw(rng, name), output.draw(rng, name), texts[name], 0)
        name = names[int(rng.integers(len(names)))]
        return StreamSpec(stream, arrival, prompt.draw(rng, name), output.draw(rng, name), texts[name],
                          int(rng.integers(len(texts[name].drafted))))

    if load.rate is not None:
        gaps = rng.exponential(1e3 / load.rate, load.requests)
        return [spec(i, float(t), i) for i, t in enumerate(np.cumsum(gaps) - gaps[0])]
    firsts = []
    for s in range(load.streams):
        chain = [spec(s, 0.0, s * load.per_stream + j) for j in range(load.per_stream)]
        for a, b in zip(chain, chain[1:]):
            a.then = b
        firsts.append(chain[0])
    return firsts


def simulate_cell(model: ServiceModel, config: RunConfig, arm: Arm, specs: list[StreamSpec]) -> dict:
    """Run one cell; its figures (ms, tokens, tokens per s, fractions; docs/simulate.md §5)."""
    gw = Gateway(model, config, arm)
    gw.start(specs)
    gw.run()
    streams = [gw.traces[s] for s in sorted(gw.traces)]
    fig = cell_figures(streams).as_dict()
    wall_ms = max(fig["wall_s"], 1e-9) * 1e3
    v, ds = gw.verifier.stats, [d.stats for d in gw.drafters]
    fig.update({
        "sessions_per_step": v.batch_sessions / v.batch_steps if v.batch_steps else 0.0,
        "verifier_steps": v.steps, "verifier_util": v.busy_ms / wall_ms,
        "drafter_util": sum(d.busy_ms for d in ds) / len(ds) / wall_ms,
        "drafter_steps": sum(d.steps for d in ds), "rounds": gw.rounds,
        "drafts_per_round": gw.submitted / gw.rounds if gw.rounds else 0.0,
        "plain_round_share": 1.0 - gw.drafted_rounds / gw.rounds if gw.rounds else 0.0,
    })
    return {k: (round(x, 6) if isinstance(x, float) else x) for k, x in fig.items()}


def simulate_grid(model: ServiceModel, config: RunConfig, arms: list[Arm], loads: list[Load],
                  groups: dict[str, list[Round]], prompt: Lengths | WorkloadLengths,
                  output: Lengths | WorkloadLengths, seed: int, order: str = "random") -> dict:
    """Every arm at every load: {"cells": {load label: {arm: figures}}, "ratios": {load label:
    {arm: aggregate tok/s / plain's, None when plain's is 0}} (when plain ran), "best_fixed": {load label: arm}}; `order`
    as `stream_specs`."""
    cells: dict[str, dict[str, dict]] = {}
    for load in loads:
        specs_of = lambda: stream_specs(load, groups, prompt, output, seed, order)  # noqa: E731 - fresh per arm
        cells[load.label] = {arm.name: simulate_cell(model, config, arm, specs_of()) for arm in arms}
    out: dict = {"cells": cells}
    if any(a.name == "plain" for a in arms):
        # None where plain's throughput rounds to 0 (a cell of ~1e-6 tok/s): no ratio to give
        out["ratios"] = {lab: {a: round(f["aggregate_tok_s"] / row["plain"]["aggregate_tok_s"], 4)
                               if row["plain"]["aggregate_tok_s"] else None
                               for a, f in row.items()} for lab, row in cells.items()}
    fixed = [a.name for a in arms if a.spec == "always"]
    if fixed:
        out["best_fixed"] = {lab: max(fixed, key=lambda a: (row[a]["aggregate_tok_s"], a))
                             for lab, row in cells.items()}
    return out
