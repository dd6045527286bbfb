"""Typed settings of the three services and the limits every setting is checked against.

This module owns the frozen dataclasses the services take (`GatewaySettings`,
`ServeSettings`, `BackendSettings`, `TelemetrySettings`), the choice lists (`VERIFY_MODES`, `COST_MODES`,
`VERIFY_NUMERICS`), the timeout limits, and `backend_target`, which validates a gRPC target.
It never reads the process environment: `services.settings` parses the variables once at
each entry point (`services.settings_vars` declares every variable; docs/settings.md lists
them) and passes these objects down. It imports nothing from the gateway, verifier or drafter packages, so
every package may import it.

A target is any gRPC target (`host:port`, `ipv4:a:p,b:p`, `dns:///name:port`) or a
comma-separated list of IP `address:port`s, which becomes an `ipv4:` / `ipv6:` target (one
channel, round_robin).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

# acceptance rules of sampled requests: dsv4.sampling.RULES, spelled here so that reading
# settings never imports torch (a test checks the two agree)
SAMPLING_RULES = ("coupled", "rejection")
# verify paths of the verifier: one forward per draft token, or one forward of the block + rollback
VERIFY_MODES = ("sequential", "batched")
STEP_BUDGETS = ("off", "trim", "full")  # services.gateway.round_policy
STEP_ALIGNMENTS = ("auto", "gather", "free", "lockstep", "pingpong", "rate")  # services.common.alignment
# where the gate's costs come from: the configured *_MS values, or measured (start-up profile + live rounds)
COST_MODES = ("configured", "measured")
# the gate's cost fields a DSPARK_GATE_*_MS variable sets; measured costs never replace them
PINNABLE_COSTS = ("draft_ms", "verify_base_ms", "verify_slope_ms", "plain_ms")
# "exact": batched verify uses fixed shapes so it is bitwise equal to plain decode (TP=1 only)
VERIFY_NUMERICS = ("fast", "exact")
# Longest accepted timeout (s), ~3 years: a gRPC deadline past ~7e9 s overflows and every
# call then fails at once with DEADLINE_EXCEEDED.
MAX_TIMEOUT_S = 1e8
# The shortest: gRPC's channel arguments carry whole ms, and a connection age that truncates
# to 0 ms turns the server's connection management off-kilter (calls then fail at random).
MIN_TIMEOUT_S = 1e-3
# grpc.max_connection_age_ms is a C int: at most 2^31 - 1 ms (~24.8 days), at least 1 ms.
MAX_CONNECTION_AGE_S = (2**31 - 1) / 1000
DEFAULT_MAX_CONNECTION_AGE_S = 300.0
# The step loops' gather window (ms): the served default, and the most a setting may ask.
# The loop never waits longer than its previous step took (services.common.step_queue), so
# this cap matters only where steps are slow: at 16 plain streams on the shared 2-core CPU
# box a 20 ms cap gathered 11-12 of 16 sessions per verifier step and 50 ms 14-15 (each
# reply crosses the gateway's one event loop in turn, so the last one comes back tens of ms
# after the first), for 25-30 % less verifier CPU per token (bench/README.md "CPU per token").
HTTP_MAX_BODY_BYTES = 4 * 2**20  # the HTTP front's request body limit (services.http.middleware)
DEFAULT_STEP_GATHER_MS = 50
MAX_STEP_GATHER_MS = 1000
# Torch intra-op threads of a backend's model threads (DSPARK_TORCH_THREADS). 1 by default: the
# bundled model's forwards are hundreds of small ops, each of which a team of workers would
# wake and wait for (services.common.threads); a large model on a many-core host sets more.
DEFAULT_TORCH_THREADS = 1
MAX_TORCH_THREADS = 1024
# where a verifier or drafter runs its model: the CPU, the current GPU, or GPU N
# (services.common.device checks that it exists before the model loads)
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d{1,3})?")
DEVICE_CHOICES = "cpu, cuda or cuda:N"
# span exporters a service can have ("none": no exporter)
EXPORTERS = ("otlp", "console", "none")
# how a service writes its log lines: plain text, or one JSON object per line (log shippers)
LOG_FORMATS = ("text", "json")

_SCHEMES = ("ipv4:", "ipv6:", "dns:", "unix:", "unix-abstract:", "vsock:", "xds:")


def backend_target(value: str, name: str = "target") -> str:
    """A gRPC target; a comma-separated list of IP `address:port`s (no scheme) becomes one
    `ipv4:` or `ipv6:` target over all of them (the gateway's channels balance round_robin).

    Raises:
        ValueError: naming `name` and the value: empty, a port outside 1..65535, a list entry
            that is not an IP address:port, or a list mixing IPv4 and IPv6.
    """
    value = value.strip()
    if not value:
        raise ValueError(f"{name}='': empty (a host:port or a gRPC target such as dns:///name:port)")
    if "," not in value or value.startswith(_SCHEMES):
        host, sep, port = value.rpartition(":")
        if sep and port.isascii() and port.isdigit() and not 0 < int(port) < 65536 \
                and not value.startswith(("unix:", "unix-abstract:")):
            raise ValueError(f"{name}={value!r}: port {port} is not in 1..65535")
        return value
    families = set()
    for entry in (e.strip() for e in value.split(",")):
        host, sep, port = entry.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        host = host[1:-1] if bracketed else host
        try:
            version = ipaddress.ip_address(host).version
            port_ok = bool(sep) and port.isascii() and port.isdigit() and 0 < int(port) < 65536
            if not port_ok or (version == 6) != bracketed:
                raise ValueError
            families.add(version)
        except ValueError:
            raise ValueError(f"{name}={value!r}: list entry {entry!r} is not an IP address:port "
                             f"([v6]:port for IPv6; name several hosts with a dns:/// target)") from None
    if len(families) > 1:
        raise ValueError(f"{name}={value!r}: mixes IPv4 and IPv6 addresses")
    entries = ",".join(e.strip() for e in value.split(","))
    return f"ipv{families.pop()}:{entries}"


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming `name` and `value` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {choices}")


def parse_device(raw: str, source: str = "--device") -> str:
    """A device spelling -> its canonical text: "cpu", or "cuda:N" ("cuda" reads as cuda:0).
    Checks the spelling only (`services.common.device.check_available` checks existence).

    Raises:
        ValueError: naming `source` and the value when it is not one of cpu, cuda, cuda:N.
    """
    text = raw.strip() if isinstance(raw, str) else raw
    if not isinstance(text, str) or not DEVICE_PATTERN.fullmatch(text):
        raise ValueError(f"{source}={raw!r}: must be {DEVICE_CHOICES}")
    return "cuda:0" if text == "cuda" else text


def check_seconds(name: str, value: float, high: float = MAX_TIMEOUT_S) -> None:
    """Raises ValueError naming `name` and `value` unless it is a number in [MIN_TIMEOUT_S, high] seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_TIMEOUT_S <= value <= high:
        raise ValueError(f"{name}={value!r}: must be a number of seconds >= {MIN_TIMEOUT_S:g} and <= {high:.10g}")


def check_count(name: str, value: int, low: int) -> None:
    """Raises ValueError naming `name` and `value` unless it is an integer >= `low`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: must be an integer >= {low}")


@dataclass(frozen=True)
class GatewaySettings:
    """What the gateway process connects to and how long it waits (all times in seconds).

    verifier_target, drafter_target: gRPC targets of the backends ("" drafter = plain decode).
    verify_mode: one of VERIFY_MODES. cost_mode: one of COST_MODES; "configured" here (no
    start-up profile, costs fixed, so an embedding or a test gets repeatable gated decisions),
    while `services.settings` reads DSPARK_GATE_COSTS with "measured" as its default.
    pinned_costs: the PINNABLE_COSTS fields a variable set; measured costs never replace them.
    regime: let the gateway's regime (`ModelRegime`) decide for gated rounds with others in
    flight: the full block, or plain where its throughput model over the verifier's step table
    says plain commits more per ms (docs/gate.md §14; it needs the table, which the gateway
    fetches under measured costs only). Off here, as cost_mode is "configured" here: it learns drafter legs from
    wall times, so an embedding or a test keeps gated decisions repeatable; a served gateway
    (`services.settings`) turns it on.
    warm_start: a gated generation's gate starts from the calibration of the finished
    generations of its sampling band (docs/gate.md §6); False here (every gate cold, so an
    embedding or a test gets the same draft lengths whatever ran before), while a served
    gateway (`services.settings`) turns it on.
    warm_max_weight: the most observations per confidence bucket a warm start lends, in (0, 1e6].
    jump_forward: submit the tokens a constrained generation's grammar forces as certain
    drafts in rounds that verify no drafts (docs/structured.md §6); False for measurement.
    step_budget: how gated generations use the verifier's step budget (STEP_BUDGETS, docs/gate.md
    §15): "off" (the gate alone chooses each length), "trim" (each verify carries its drafts'
    survival estimates and the step may cut the gate's length), "full" (the gate keeps the
    pre-draft decision, the step chooses every length). "trim" and "full" need verify_mode
    "batched" (the verifier's step cuts batched blocks only).
    round_timeout_s: deadline of one backend reply. generation_timeout_s: deadline of one
    generation's backend streams. startup_timeout_s: deadline of the backends' Info at start.
    drafter_failovers: drafter re-primes a generation may make after a drafter failure.
    token: bearer token every client call must carry ("" = none; never in repr).
    sampling_rule: the acceptance rule of sampled requests that leave theirs unset, one of
    SAMPLING_RULES ("coupled": reproducible per seed; "rejection": see docs/sampling.md).
    Raises:
        ValueError: a field outside its range (named with its value; the token's value is not shown).
    """

    verifier_target: str = "127.0.0.1:50051"
    drafter_target: str = "127.0.0.1:50052"
    verify_mode: str = "batched"
    cost_mode: str = "configured"
    round_timeout_s: float = 30.0
    generation_timeout_s: float = 600.0
    startup_timeout_s: float = 10.0
    drafter_failovers: int = 2
    token: str = field(default="", repr=False)
    pinned_costs: tuple[str, ...] = ()
    sampling_rule: str = "coupled"
    regime: bool = False
    warm_start: bool = False
    warm_max_weight: float = 10.0
    jump_forward: bool = True
    step_budget: str = "off"

    def __post_init__(self) -> None:
        check_choice("verify_mode", self.verify_mode, VERIFY_MODES)
        check_choice("step_budget", self.step_budget, STEP_BUDGETS)
        if self.step_budget != "off" and self.verify_mode != "batched":  # the verifier cuts batched blocks only
            raise ValueError(f"step_budget={self.step_budget!r} (DSPARK_STEP_BUDGET) needs verify_mode='batched' "
                             f"(DSPARK_VERIFY_MODE), not {self.verify_mode!r}: a sequential verify is never cut "
                             f"by the step's budget")
        check_choice("sampling_rule", self.sampling_rule, SAMPLING_RULES)
        check_choice("cost_mode", self.cost_mode, COST_MODES)
        for name in ("regime", "warm_start", "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a bool")
        weight = self.warm_max_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
            raise ValueError(f"warm_max_weight={weight!r}: must be a number in (0, 1e6]")
        if isinstance(self.pinned_costs, str):
            raise ValueError(f"pinned_costs={self.pinned_costs!r}: must be a tuple of field names")
        object.__setattr__(self, "pinned_costs", tuple(self.pinned_costs))
        for name in self.pinned_costs:
            check_choice("pinned_costs entry", name, PINNABLE_COSTS)
        for name in ("round_timeout_s", "generation_timeout_s", "startup_timeout_s"):
            check_seconds(name, getattr(self, name))
        check_count("drafter_failovers", self.drafter_failovers, 0)
        if self.token and not valid_token(self.token):
            raise ValueError("token: must be printable ASCII without spaces (value not shown)")


def valid_token(token: str) -> bool:
    """Whether `token` can travel in an `authorization: Bearer` gRPC metadata value."""
    return token.isascii() and token.isprintable() and " " not in token


@dataclass(frozen=True)
class ServeSettings:
    """Process settings of `dspark serve` (every service).

    health_port: a plaintext port serving only grpc.health.v1 (Kubernetes `grpc:` probes
        cannot present a client certificate); None = no such port.
    drain_timeout_s: how long SIGTERM lets open streams finish (s).
    max_connection_age_s: after it a server asks a client to reconnect (open streams are not
        cut), so a `dns:///` client re-resolves and sees new replicas (s, <= MAX_CONNECTION_AGE_S).
    Raises:
        ValueError: a field outside its range (named with its value).
    """

    health_port: int | None = None
    drain_timeout_s: float = 30.0
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S

    def __post_init__(self) -> None:
        if self.health_port is not None and not (isinstance(self.health_port, int) and 0 < self.health_port < 65536):
            raise ValueError(f"health_port={self.health_port!r}: must be a port in 1..65535")
        check_seconds("drain_timeout_s", self.drain_timeout_s)
        check_seconds("max_connection_age_s", self.max_connection_age_s, MAX_CONNECTION_AGE_S)


@dataclass(frozen=True)
class BackendSettings:
    """Settings of a verifier or drafter process.

    max_sessions: concurrent sessions (one per generation); None: sized from the memory
    available at start-up when the entry point passes that figure, else 16
    (`services.common.limits`). verify_mode: the verifier's default verify path
    (VERIFY_MODES). verify_numerics: "exact" makes the verifier's batched verify bitwise
    equal to decode (VERIFY_NUMERICS). prefill_chunk: the most prompt tokens the verifier's
    step loop forwards in one step (`services.verifier.batcher`). step_profile: the verifier
    times batch steps over dummy sessions before it serves, seeding its step-time table
    (False here, so embeddings and tests start at once; a served backend, `services.settings`,
    turns it on).
    step_gather_ms: the longest wait (ms, 0..MAX_STEP_GATHER_MS) of the verifier's and the
    drafter's step loops, before a step, for the sessions the previous step answered to send
    again, never longer than that step took (`services.common.step_queue`); 0 here (steps start as soon as work is queued),
    `services.settings` defaults it to DEFAULT_STEP_GATHER_MS.
    step_alignment: how the verifier's step loop gathers sessions before a step
    (STEP_ALIGNMENTS, `services.common.alignment`; "auto": `default_alignment(device)`; the
    drafter's loop always gathers).
    torch_threads: torch intra-op threads of every thread of the process that runs the model
    (1..MAX_TORCH_THREADS; `services.common.threads`). device: where the model runs, "cpu" or
    "cuda:N" (`parse_device`'s canonical spelling; the verifier at TP > 1 puts rank r on
    cuda:r whatever N).
    Raises:
        ValueError: a field outside its range (named with its value).
    """

    max_sessions: int | None = None
    verify_mode: str = "batched"
    verify_numerics: str = "fast"
    prefill_chunk: int = 64
    step_profile: bool = False
    step_gather_ms: int = 0
    step_alignment: str = "auto"
    torch_threads: int = DEFAULT_TORCH_THREADS
    device: str = "cpu"

    def __post_init__(self) -> None:
        if parse_device(self.device, "device") != self.device:
            raise ValueError(f"device={self.device!r}: must be spelled cpu or cuda:N")
        if self.max_sessions is not None:
            check_count("max_sessions", self.max_sessions, 1)
        check_count("torch_threads", self.torch_threads, 1)
        if self.torch_threads > MAX_TORCH_THREADS:
            raise ValueError(f"torch_threads={self.torch_threads}: must be <= {MAX_TORCH_THREADS}")
        check_count("prefill_chunk", self.prefill_chunk, 1)
        check_count("step_gather_ms", self.step_gather_ms, 0)
        if self.step_gather_ms > MAX_STEP_GATHER_MS:
            raise ValueError(f"step_gather_ms={self.step_gather_ms}: must be <= {MAX_STEP_GATHER_MS}")
        if not isinstance(self.step_profile, bool):
            raise ValueError(f"step_profile={self.step_profile!r}: must be a bool")
        check_choice("verify_mode", self.verify_mode, VERIFY_MODES)
        check_choice("verify_numerics", self.verify_numerics, VERIFY_NUMERICS)
        check_choice("step_alignment", self.step_alignment, STEP_ALIGNMENTS)


@dataclass(frozen=True)
class TelemetrySettings:
    """Which span exporters a service's tracer provider gets.

    exporters: names from EXPORTERS ("none" adds nothing; "otlp" is configured by the standard
        `OTEL_EXPORTER_OTLP_*` variables, which the OTLP exporter reads itself).
    jsonl_path: append every span as one JSON line to this file (None = no file).
    service_name: `service.name` on spans (None = the service's own, e.g. "dspark-gateway").
    Raises:
        ValueError: an exporter name not in EXPORTERS (named).
    """

    exporters: tuple[str, ...] = ()
    jsonl_path: str | None = None
    service_name: str | None = None

    def __post_init__(self) -> None:
        for name in self.exporters:
            if name not in EXPORTERS:
                raise ValueError(f"exporter {name!r}: supported exporters are {EXPORTERS}")
