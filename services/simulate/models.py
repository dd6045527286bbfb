"""Step-time models of the simulated services and where they come from (docs/simulate.md §2).

A `ServiceModel` gives, in ms of virtual time:

* the verifier's step: `verifier.ms_at(rows) + session_ms * sessions`, rows = decode + verify
  + prompt rows forwarded in the step (a `StepTimes` table, the very type the gateway prices
  drafts with), sessions = the sessions in the step (their KV reads);
* the drafter's step: `draft.ms_at(drafting sessions)` when any session drafts plus
  `commit.ms_at(rows committed)` when any session commits (`StepTimes` over sessions and
  over tap rows written: a round commits its accepted drafts and bonus token);
* `rpc_ms`: one gateway <-> service round trip, paid by every call on top of its step;
* `event_loop`: each service's own work on a call outside its steps (gRPC, protobuf,
  handing the reply over), `call_ms + row_ms * rows` per call, done one call at a time
  beside the steps (the served services' CPU outside their step threads, docs/simulate.md
  §5.2; 0 unless a shape gives it).

Sources (`load_model`): a built-in shape (`cpu`, `seed`, `gpu`), a JSON or TOML shape file,
`dspark calibrate` output (its DSPARK_GATE_*_MS lines), or a verifier's `Info`
(host:port: its profiled step table). Every source is checked: a negative, non-finite or
non-monotone time raises ValueError naming the field and the value.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from services.gateway.decision import CostModel
from services.common import files
from services.common.budget import StepTimes
from services.simulate.roofline import PEER_DRAFT_MS, PEER_PLAIN_MS, PEER_VERIFY, gpu_tables

SHAPES = ("cpu", "seed", "gpu")
SHAPE_DIR = Path(__file__).resolve().parent / "shapes"
# The seed shape's batch scaling (docs/simulate.md §2.2): a row of another session costs what a
# drafted row of the same session costs, the reference verify slope.
SEED = {"draft_ms": 196.0, "verify_base_ms": 300.0, "verify_slope_ms": 109.0, "plain_ms": 303.0, "commit_ms": 0.0}
CALIBRATE_KEYS = {"DRAFT_MS": "draft_ms", "VERIFY_BASE_MS": "verify_base_ms", "VERIFY_SLOPE_MS": "verify_slope_ms",
                  "PLAIN_MS": "plain_ms", "COMMIT_MS": "commit_ms"}
MAX_SESSIONS = 4096  # the widest drafter step a single-stream source is extended to
MAX_MS = 1e7  # the bound on a per-session, per-call or gateway cost (ms), as the gate's CostModel's
MAX_FILE_BYTES = 1 << 20  # a cost file is a few tables; anything larger (or not a file) is refused


@dataclass(frozen=True)
class CallCost:
    """A service's event-loop work on one call, outside its steps: call_ms + row_ms x rows
    (ms; rows: the call's rows, a verify k + 1, a decode 1, a prefill its prompt, a commit
    its tap rows, a draft 1). Raises ValueError naming the field when either is negative,
    not finite or above MAX_MS."""

    call_ms: float = 0.0
    row_ms: float = 0.0

    def __post_init__(self) -> None:
        for field in ("call_ms", "row_ms"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_MS:
                raise ValueError(f"event_loop {field}={value!r}: must be a finite number of ms in [0, {MAX_MS:g}]")

    def ms(self, rows: int) -> float:
        """One call of `rows` rows (ms)."""
        return self.call_ms + self.row_ms * rows

    def __bool__(self) -> bool:
        return self.call_ms > 0 or self.row_ms > 0


@dataclass(frozen=True)
class ServiceModel:
    """Step times of one deployment (module docstring). name: where it came from.

    session_ms: a verifier step's cost per session in it (ms); rpc_ms: one call's network time,
    half each way (ms); gateway_ms: the gateway's own work on one reply of the verifier or a
    drafter (ms: streaming its tokens to the client, the next call's decisions), done one
    reply at a time, as the gateway's one event loop does. verifier_loop, drafter_loop: each
    service's event-loop work per call outside its steps (`CallCost`; none by default).
    Raises ValueError naming the field when session_ms, rpc_ms or gateway_ms is negative, not
    finite or above MAX_MS.
    """

    name: str
    verifier: StepTimes
    draft: StepTimes
    commit: StepTimes
    session_ms: float = 0.0
    rpc_ms: float = 0.0
    gateway_ms: float = 0.0
    verifier_loop: CallCost = CallCost()
    drafter_loop: CallCost = CallCost()

    def __post_init__(self) -> None:
        for field in ("session_ms", "rpc_ms", "gateway_ms"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_MS:
                raise ValueError(f"{self.name}: {field}={value!r}: must be a finite number of ms in "
                                 f"[0, {MAX_MS:g}]")

    def verifier_ms(self, rows: int, sessions: int) -> float:
        """One verifier step of `rows` tokens over `sessions` sessions (ms)."""
        return self.verifier.ms_at(rows) + self.session_ms * sessions

    def drafter_ms(self, drafts: int, commit_rows: int) -> float:
        """One drafter step with `drafts` drafting sessions and `commit_rows` tap rows committed
        over all its committing sessions (ms)."""
        return (self.draft.ms_at(drafts) if drafts else 0.0) + \
            (self.commit.ms_at(commit_rows) if commit_rows else 0.0)

    def single_stream(self, block_size: int) -> CostModel:
        """The costs one generation alone pays, as the gate's `CostModel` (what `dspark
        calibrate` would fit on this deployment): verify(n) = step(n + 1 rows) + rpc, plain =
        step(1 row) + rpc, draft and commit at one session + rpc; a verify table for
        n = 1..block_size keeps the model's own shape."""
        plain = self.verifier_ms(1, 1) + self.rpc_ms
        table = tuple(self.verifier_ms(n + 1, 1) + self.rpc_ms for n in range(1, block_size + 1))
        slope = (table[-1] - table[0]) / max(block_size - 1, 1)
        return CostModel(self.drafter_ms(1, 0) + self.rpc_ms, table[0] - slope, slope, plain,
                         self.drafter_ms(0, 1) + self.rpc_ms, table, source=self.name)

    def to_dict(self) -> dict:
        """The model as a shape file's JSON object (docs/simulate.md §2)."""
        def table(t: StepTimes, key: str) -> dict:
            return {key: list(t.rows), "ms": list(t.ms)}
        loops = {name: {"call_ms": c.call_ms, "row_ms": c.row_ms}
                 for name, c in (("verifier", self.verifier_loop), ("drafter", self.drafter_loop)) if c}
        return {"name": self.name, "verifier": {**table(self.verifier, "rows"), "session_ms": self.session_ms},
                "drafter": {"draft": table(self.draft, "sessions"), "commit": table(self.commit, "rows")},
                "rpc_ms": self.rpc_ms, "gateway_ms": self.gateway_ms, **({"event_loop": loops} if loops else {})}


def _table(obj: object, key: str, where: str) -> StepTimes:
    """A StepTimes from {key: [...], "ms": [...]}; errors name `where`."""
    if not isinstance(obj, dict) or set(obj) - {key, "ms"} or key not in obj or "ms" not in obj:
        raise ValueError(f"{where}: must be an object with exactly '{key}' and 'ms' lists")
    xs, ms = obj[key], obj["ms"]
    if not isinstance(xs, list) or not isinstance(ms, list):
        raise ValueError(f"{where}: '{key}' and 'ms' must be lists")
    for i, m in enumerate(ms):
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
            raise ValueError(f"{where}.ms[{i}]={m!r}: a step time must be a finite number of ms >= 0")
        if i and m < ms[i - 1]:
            raise ValueError(f"{where}.ms[{i}]={m!r} < ms[{i - 1}]={ms[i - 1]!r}: step times must not fall "
                             f"as {key} grow")
    for i, x in enumerate(xs):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"{where}.{key}[{i}]={x!r}: must be a number")
    try:
        return StepTimes(tuple(xs), tuple(ms))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def model_from_dict(obj: object, name: str) -> ServiceModel:
    """A ServiceModel from a shape file's object (docs/simulate.md §2). Raises ValueError
    naming the field on an unknown key, a missing table or a bad value."""
    if not isinstance(obj, dict):
        raise ValueError(f"{name}: a shape file holds one object")
    unknown = set(obj) - {"name", "source", "verifier", "drafter", "rpc_ms", "gateway_ms", "event_loop", "notes"}
    if unknown:
        hint = "; a round-record file goes to --rounds" if obj.get("format") == "dspark-rounds" else ""
        raise ValueError(f"{name}: unknown key(s) {sorted(unknown)}{hint}")
    ver, dra = obj.get("verifier"), obj.get("drafter")
    if not isinstance(ver, dict) or not isinstance(dra, dict):
        raise ValueError(f"{name}: needs 'verifier' and 'drafter' objects")
    if not isinstance(obj.get("name", name), str):
        raise ValueError(f"{name}: name={obj['name']!r}: must be a string")
    session_ms = ver.get("session_ms", 0.0)
    verifier = _table({k: v for k, v in ver.items() if k != "session_ms"}, "rows", f"{name}: verifier")
    if set(dra) - {"draft", "commit"}:
        raise ValueError(f"{name}: drafter: unknown key(s) {sorted(set(dra) - {'draft', 'commit'})}")
    draft = _table(dra.get("draft"), "sessions", f"{name}: drafter.draft")
    commit = _table(dra.get("commit", {"rows": [1], "ms": [0.0]}), "rows", f"{name}: drafter.commit")
    loops = _event_loops(obj.get("event_loop", {}), name)
    return ServiceModel(str(obj.get("name", name)), verifier, draft, commit, session_ms, obj.get("rpc_ms", 0.0),
                        obj.get("gateway_ms", 0.0), loops.get("verifier", CallCost()), loops.get("drafter", CallCost()))


def _event_loops(obj: object, name: str) -> dict[str, CallCost]:
    """{"verifier" | "drafter": CallCost} from a shape's "event_loop" object. Raises ValueError
    naming the field on an unknown service or key, or a bad value."""
    if not isinstance(obj, dict) or set(obj) - {"verifier", "drafter"}:
        got = f"unknown key(s) {sorted(set(obj) - {'verifier', 'drafter'})}" if isinstance(obj, dict) else repr(obj)
        raise ValueError(f"{name}: event_loop: {got}: must be an object with 'verifier' and/or 'drafter' (the "
                         f"gateway's turn is gateway_ms)")
    out = {}
    for service, cost in obj.items():
        if not isinstance(cost, dict) or set(cost) - {"call_ms", "row_ms"}:
            got = f"unknown key(s) {sorted(set(cost) - {'call_ms', 'row_ms'})}" if isinstance(cost, dict) \
                else repr(cost)
            raise ValueError(f"{name}: event_loop.{service}: {got}: must be an object with 'call_ms' and/or "
                             f"'row_ms'")
        try:
            out[service] = CallCost(cost.get("call_ms", 0.0), cost.get("row_ms", 0.0))
        except ValueError as exc:
            raise ValueError(f"{name}: {service} {exc}") from None
    return out


def from_single_stream(costs: dict[str, float], name: str, max_rows: int = 8192) -> ServiceModel:
    """A ServiceModel from one stream's costs (the seed figures, `dspark calibrate` output):
    the verifier step is plain_ms at one row, verify(1) = verify_base_ms + verify_slope_ms at
    two (never below plain_ms), and grows by verify_slope_ms per further row, rows of other
    sessions costing as a drafted row does; a draft of s sessions costs draft_ms times
    1 + (s - 1) * verify_slope_ms / plain_ms, the verifier's measured ratio of one more row to
    a whole step, and a commit of r rows commit_ms times 1 + (r - 1) * that ratio
    (docs/simulate.md §2.2). Raises ValueError naming
    a cost that is negative or not finite, or a missing one."""
    for key in ("draft_ms", "verify_slope_ms", "plain_ms"):
        value = costs.get(key)
        if value is None:
            raise ValueError(f"{name}: {key} is missing")
    for key, value in costs.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}: {key}={value!r} must be a finite number of ms >= 0")
    plain, slope = costs["plain_ms"], costs["verify_slope_ms"]
    if plain <= 0:
        raise ValueError(f"{name}: plain_ms={plain!r} must be > 0")
    two = max(plain, costs.get("verify_base_ms", plain) + slope)  # verify(1): two rows
    grow = 1.0 + (MAX_SESSIONS - 1) * slope / plain
    draft, commit = costs["draft_ms"], costs.get("commit_ms", 0.0)
    try:
        verifier = StepTimes((1.0, 2.0, float(max_rows)), (plain, two, two + slope * (max_rows - 2)))
        return ServiceModel(name, verifier, StepTimes((1.0, float(MAX_SESSIONS)), (draft, draft * grow)),
                            StepTimes((1.0, float(MAX_SESSIONS)), (commit, commit * grow)))
    except ValueError as exc:  # a table extended past StepTimes' bound: name the source
        raise ValueError(f"{name}: {exc} (extended to {max_rows} rows and {MAX_SESSIONS} sessions from "
                         f"{', '.join(f'{k}={v!r}' for k, v in costs.items())})") from None


def parse_calibrate(text: str, name: str) -> dict[str, float]:
    """The costs of `dspark calibrate` output (DSPARK_GATE_<X>_MS=value lines; other lines are
    ignored). The deprecated DEEPSEEK_DSPARK_GATE_<X>_MS spelling, which calibrate wrote before
    the settings took the one DSPARK_ prefix, is read too, so older fits still load. Raises
    ValueError naming the line of a value that is not a number, or the text when no line is one."""
    costs = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\s*(?:export\s+)?(?:DEEPSEEK_)?DSPARK_GATE_([A-Z_]+)=(\S*)\s*", line)
        if m and m.group(1) in CALIBRATE_KEYS:
            try:
                costs[CALIBRATE_KEYS[m.group(1)]] = float(m.group(2))
            except ValueError:
                raise ValueError(f"{name}: {line.strip()!r}: not a number") from None
    if not costs:
        raise ValueError(f"{name}: no DSPARK_GATE_*_MS line (is it `dspark calibrate` output?)")
    return costs


def load_model(source: str) -> ServiceModel:
    """The model named by `source`: a built-in shape, `info:HOST:PORT`, or a file (.json /
    .toml shape file, anything else `dspark calibrate` output). Raises ValueError naming the
    source on an unreadable file or a bad value."""
    if source == "seed":
        return from_single_stream(SEED, "seed")
    if source == "gpu":
        return gpu_model()
    if source == "cpu":
        source = str(SHAPE_DIR / "cpu.json")
    if source.startswith("info:"):
        return model_from_info(source[len("info:"):])
    path = Path(source)
    text = _read_cost_file(path, source)
    if path.suffix == ".json":
        try:
            return model_from_dict(json.loads(text), path.name)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path.name}: not JSON ({exc})") from None
    if path.suffix == ".toml":
        try:
            return model_from_dict(tomllib.loads(text), path.name)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path.name}: not TOML ({exc})") from None
    return from_single_stream(parse_calibrate(text, path.name), path.name)


def _read_cost_file(path: Path, source: str) -> str:
    """The text of a cost file. Raises ValueError naming `source` when it is missing, not a
    regular file (a directory, /dev/zero: read whole it would never end), over
    MAX_FILE_BYTES or not UTF-8."""
    try:
        return files.read_text(path, MAX_FILE_BYTES)
    except OSError as exc:
        raise ValueError(f"--costs {source!r}: cannot read it ({exc.__class__.__name__}); give a shape name "
                         f"({', '.join(SHAPES)}), a .json/.toml shape file or `dspark calibrate` output") from None
    except ValueError as exc:
        raise ValueError(f"--costs {source!r}: {exc}; a cost file is a regular file of a few tables") from None


def model_from_info(target: str, timeout_s: float = 10.0) -> ServiceModel:
    """The verifier's profiled step table from its Info at `target` (host:port), with the
    drafter's costs as the seed ratio of the verifier's one-row step (no drafter reports a
    table): draft = 0.65 x step(1 row), the reference 196 / 303 ms. Raises ValueError when
    the call fails or the verifier reports no table."""
    import grpc

    from dspark_proto.v1 import common_pb2, verifier_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            info = verifier_pb2_grpc.VerifierStub(channel).Info(common_pb2.InfoRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        hint = " (is it the verifier's address? a gateway or drafter has no verifier Info)" \
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED else ""
        raise ValueError(f"info:{target}: Info failed ({exc.code().name}){hint}") from None
    table = StepTimes.from_identity(info)
    if table is None:
        raise ValueError(f"info:{target}: the verifier reports no step table (DSPARK_STEP_PROFILE=0?)")
    draft = SEED["draft_ms"] / SEED["plain_ms"] * table.ms[0]
    return ServiceModel(f"info:{target}", table, StepTimes((1.0,), (draft,)), StepTimes((1.0,), (0.0,)))


def gpu_model() -> ServiceModel:
    """The `gpu` shape as a `ServiceModel`."""
    verifier, draft, commit, session_ms = gpu_tables()
    return ServiceModel("gpu", verifier, draft, commit, session_ms)


def roofline_check() -> list[tuple[str, float, float]]:
    """(cost, model ms, peer ms) at one stream: plain, verify(1), verify(5), draft."""
    model = gpu_model()
    verify = [model.verifier_ms(n + 1, 1) for n in (1, 5)]
    return [("plain", model.verifier_ms(1, 1), PEER_PLAIN_MS),
            ("verify(1)", verify[0], PEER_VERIFY[0] + PEER_VERIFY[1]),
            ("verify(5)", verify[1], PEER_VERIFY[0] + 5 * PEER_VERIFY[1]),
            ("draft", model.drafter_ms(1, 0), PEER_DRAFT_MS)]
