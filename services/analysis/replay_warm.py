"""The replay's warm start: each workload's gate borrows the calibration of the OTHER workloads.

Owns one function of the replay (docs/gate.md §10, "Warm per workload"): what a gated
workload warm-starts from without seeing its own rounds. It must not replay policies itself
(`replay.py` does) or read files.

Leave-one-workload-out: every workload is first replayed through a cold gate, as a gateway
would have served it. A workload's warm start is then the band a gateway would hold after
serving every other workload of the file, in file order, as one greedy band
(`services.gateway.warm.WarmBands`): their gate counters merged and scaled to `max_weight`
observations per bucket, and the last drafted rounds of the last of them re-priced by the
first pre-draft decision. A workload's own rounds never reach its warm start, so nothing is
learned from the rounds being scored. A file of one workload replays cold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.gateway.gate import Calibration, Gate, GateConfig
from services.analysis.references import gate_config_for_replay, replay_through_gate
from services.gateway.rounds import Round
from services.gateway.warm import GREEDY_BAND, WarmBands, WarmStart


def lowo_calibrations(groups: Mapping[str, Sequence[Round]], config: GateConfig,
                      warm: WarmStart) -> dict[str, Calibration | None]:
    """Per workload (the keys of `groups`, in file order): the `Calibration` its gated replay
    warm-starts from, built from the cold gated replays of the other workloads under `config`
    (gate enabled, margin gate off); None when no other workload verified a draft."""
    served = {}
    for name, rounds in groups.items():
        gate = Gate(gate_config_for_replay(config))
        served[name] = (replay_through_gate(rounds, gate).gate, gate.recent_confidences())
    out = {}
    for name in groups:
        bands = WarmBands(warm)
        for other, (stats, recent) in served.items():
            if other != name:
                bands.add(GREEDY_BAND, stats, recent)
        out[name] = bands.calibration(GREEDY_BAND)
    return out
