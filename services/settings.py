"""The one reader of the process environment: every variable the project reads, parsed once.

Each entry point (`dspark serve|up|generate|replay`, `training/demo.py`) calls `read_settings`
(or one section reader) with `os.environ` and passes the typed objects down; nothing below
reads the environment. The objects live next to their users and validate themselves; this
module maps variables to their fields and names the variable and value in every error.
Unset means the default; the "empty" column says what an empty value means.

| variable | default | empty | section: field |
|---|---|---|---|
| DSPARK_CHECKPOINT | unset (the random tiny model) | unset | checkpoint (`--checkpoint` wins) |
| DSPARK_VERIFIER_TARGET | 127.0.0.1:50051 | error | gateway: verifier_target |
| DSPARK_DRAFTER_TARGET | 127.0.0.1:50052 | no drafter | gateway: drafter_target |
| DSPARK_VERIFY_MODE | batched | error | gateway, backend: verify_mode (sequential, batched) |
| DSPARK_GATE_COSTS | measured | error | gateway: cost_mode (configured, measured) |
| DSPARK_ROUND_TIMEOUT_S | 30 | error | gateway: round_timeout_s |
| DSPARK_GENERATION_TIMEOUT_S | 600 | error | gateway: generation_timeout_s |
| DSPARK_STARTUP_TIMEOUT_S | 10 | error | gateway: startup_timeout_s |
| DSPARK_DRAFTER_FAILOVERS | 2 | error | gateway: drafter_failovers |
| DSPARK_SAMPLING_RULE | coupled | error | gateway: sampling_rule (coupled, rejection: sampled requests that leave theirs unset) |
| DSPARK_GATE_LOAD | 1 | default | gateway: load_aware (0, 1: price gated drafts at the verifier's load) |
| DSPARK_GATE_REGIME | 1 | default | gateway: regime (0, 1: run gated rounds plain at a concurrency where the gateway measures more tokens per ms without drafting) |
| DSPARK_GATE_WARM_START | 1 | default | gateway: warm_start (0, 1: gated generations start from their sampling band's calibration) |
| DSPARK_GATE_WARM_WEIGHT | 10 | error | gateway: warm_max_weight (observations per bucket a warm start lends, in (0, 1e6]) |
| DSPARK_GATEWAY_TOKEN | unset | unset | gateway: token; `dspark generate`'s token |
| DSPARK_GATEWAY_TLS_CERT, _KEY | unset | unset | gateway_tls (a pair) |
| DSPARK_METRICS_PORT | unset | unset | metrics_port (every service; `--metrics-port` wins) |
| DSPARK_LOG_FORMAT | text | text | log_format (text, json: one JSON object per log line) |
| DSPARK_HTTP_PORT | unset (off) | unset | http_port (gateway: the OpenAI-compatible HTTP front; `--http-port` wins) |
| DEEPSEEK_DSPARK_GATE | 0 | error | gate: enabled |
| DEEPSEEK_DSPARK_GATE_MARGIN_THRESHOLD | 0.0 | error | gate: margin_threshold |
| DEEPSEEK_DSPARK_GATE_MARGIN | 1.15 | error | gate: margin |
| DEEPSEEK_DSPARK_GATE_MIN_DRAFT | 0 | error | gate: min_draft |
| DEEPSEEK_DSPARK_GATE_DECAY | 0.9 | error | gate: decay |
| DEEPSEEK_DSPARK_GATE_DRAFT_MS | 196 | error | gate: draft_ms |
| DEEPSEEK_DSPARK_GATE_VERIFY_BASE_MS | 300 | error | gate: verify_base_ms |
| DEEPSEEK_DSPARK_GATE_VERIFY_SLOPE_MS | 109 | error | gate: verify_slope_ms |
| DEEPSEEK_DSPARK_GATE_PLAIN_MS | 303 | error | gate: plain_ms |
| DSPARK_MAX_SESSIONS | sized from memory (`services.common.limits`) | error | backend: max_sessions |
| DSPARK_PREFILL_CHUNK | 64 | error | backend: prefill_chunk (prompt tokens per verifier step, 1..1048576) |
| DSPARK_VERIFY_NUMERICS | fast | error | backend: verify_numerics (fast, exact) |
| DSPARK_DEVICE | cpu | error | backend: device (cpu, cuda, cuda:N: where the verifier's or drafter's model runs; `--device` wins) |
| DSPARK_STEP_PROFILE | 1 | default | backend: step_profile (0, 1: the verifier's start-up step-time profile) |
| DSPARK_STEP_GATHER_MS | 50 | error | backend: step_gather_ms (0..1000: the longest a verifier or drafter step waits for the sessions the previous step answered, never longer than that step took; 0 = not at all) |
| DSV4_MOE_DETERMINISTIC_REDUCE | 1 | default | model: moe_deterministic_reduce |
| DSV4_KERNELS | torch | default | model: kernels (torch, triton) |
| DEEPSEEK_GPU_MOE_MULTI_TOKEN_FP4 | 0 | default | model: moe_multi_token_fp4 |
| DSV4_TP_INIT_TIMEOUT_S | 600 | default | tp: init_timeout_s |
| DSV4_TP_CALL_TIMEOUT_S | 120 | default | tp: call_timeout_s |
| DSV4_TOPK_DIAG | 0 (off) | off | topk: k |
| DSV4_TOPK_DIAG_DIR | . | . | topk: folder |
| DSPARK_HEALTH_PORT | unset | unset | serve: health_port |
| DSPARK_DRAIN_TIMEOUT_S | 30 | error | serve: drain_timeout_s |
| DSPARK_MAX_CONNECTION_AGE_S | 300 | error | serve: max_connection_age_s |
| DSPARK_TLS_CERT, _KEY, _CA | unset | unset | tls (all three or none) |
| DSPARK_TLS_SERVER_NAME | unset | unset | tls: server_name (gateway side) |
| OTEL_TRACES_EXPORTER | none | none | telemetry: exporters (otlp, console, none; comma-separated) |
| OTEL_SERVICE_NAME | dspark-<service> | default | telemetry: service_name |
| DSPARK_TRACES_JSONL | unset | unset | telemetry: jsonl_path |

Times are seconds, spelled as plain ASCII decimals; gateway, serve and TP timeouts are at least
`MIN_TIMEOUT_S` (1 ms) and at most `MAX_TIMEOUT_S` (the connection age at most
`MAX_CONNECTION_AGE_S`). The OTLP exporter reads the standard `OTEL_EXPORTER_OTLP_*` variables
itself. Sections a service does not use stay None.
A `DEEPSEEK_DSPARK_GATE_*_MS` variable that is set also pins its field (gateway:
pinned_costs): the measured costs of DSPARK_GATE_COSTS=measured never replace it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from dsv4.settings import (ENV_KERNELS, ENV_MOE_DETERMINISTIC_REDUCE, ENV_MOE_MULTI_TOKEN_FP4, KERNEL_BACKENDS,
                           Settings as ModelSettings)
from services.common.settings import (COST_MODES, DEFAULT_STEP_GATHER_MS, DEFAULT_TORCH_THREADS, EXPORTERS,
                                      LOG_FORMATS, MAX_CONNECTION_AGE_S, MAX_STEP_GATHER_MS, MAX_TIMEOUT_S,
                                      MAX_TORCH_THREADS, MIN_TIMEOUT_S, PINNABLE_COSTS, SAMPLING_RULES, VERIFY_MODES, VERIFY_NUMERICS, BackendSettings,
                                      parse_device,
                                      GatewaySettings, ServeSettings,
                                      TelemetrySettings, backend_target, valid_token)
from services.common.tls import PemFile, TlsFiles, load_tls
from services.gateway.gate import ENV_VARS as GATE_ENV_VARS, GateConfig
from services.gateway.values import decimal, parse_setting, short_repr
from services.gateway.warm import DEFAULT_MAX_WEIGHT, parse_warm_start

if TYPE_CHECKING:  # both import torch: loaded only by the sections that need them
    from services.verifier.topk_diag import TopKDiagSettings
    from services.verifier.tp import TPSettings

Environ = Mapping[str, str]
SERVICES = ("verifier", "drafter", "gateway")
TOKEN_VAR = "DSPARK_GATEWAY_TOKEN"
# A served gateway prices rounds with costs measured on its own backends unless told otherwise
# (`GatewaySettings` itself defaults to "configured" for embeddings and tests).
DEFAULT_COST_MODE = "measured"


@dataclass(frozen=True)
class ProcessSettings:
    """Everything one `dspark serve <service>` process reads, parsed before any model loads.

    checkpoint: the model folder (None = the bundled or random tiny model); serve, telemetry
    and tls (mTLS files, None = plaintext) apply to every service. model, backend: verifier
    and drafter; tp, topk (None = no dumps): verifier; gateway, gate, gateway_tls (None =
    plaintext client port), http_port (None = no HTTP front): gateway. metrics_port (None = no
    Prometheus endpoint) and log_format (LOG_FORMATS) apply to every service. Sections of the
    other services are None.
    """

    service: str
    checkpoint: str | None
    serve: ServeSettings
    telemetry: TelemetrySettings
    tls: TlsFiles | None
    model: ModelSettings | None = None
    backend: BackendSettings | None = None
    tp: TPSettings | None = None
    topk: TopKDiagSettings | None = None
    gateway: GatewaySettings | None = None
    gate: GateConfig | None = None
    gateway_tls: TlsFiles | None = None
    metrics_port: int | None = None
    http_port: int | None = None
    log_format: str = "text"


def read_settings(environ: Environ, service: str, *, tp: int = 1, checkpoint_flag: str | None = None,
                  metrics_port_flag: int | None = None, http_port_flag: int | None = None,
                  device_flag: str | None = None) -> ProcessSettings:
    """Parse every variable `service` reads (module table); flags given win over variables.

    tp: the verifier's tensor-parallel ranks (`--tp`), checked against the numerics;
    device_flag: `--device` (None: DSPARK_DEVICE, else cpu).
    Raises:
        ValueError: naming the variable (or flag) and its value; an unknown service.
    """
    if service not in SERVICES:
        raise ValueError(f"service={service!r}: must be one of {SERVICES}")
    common = dict(service=service, checkpoint=checkpoint(checkpoint_flag, environ),
                  serve=serve_settings(environ), telemetry=telemetry_settings(environ), tls=tls_files(environ),
                  metrics_port=metrics_port(metrics_port_flag, environ), log_format=log_format(environ))
    if service == "gateway":
        gateway_tls = gateway_tls_files(environ)
        return ProcessSettings(**common, gateway=gateway_settings(environ), gate=gate_config(environ),
                               gateway_tls=gateway_tls,
                               http_port=http_port(http_port_flag, environ, gateway_tls is not None))
    backend = backend_settings(environ, device_flag)
    if service == "drafter":
        return ProcessSettings(**common, model=model_settings(environ), backend=backend)
    if tp > 1 and backend.verify_numerics != "fast":  # what `app.load_trunk` refuses, before it loads
        raise ValueError(f"DSPARK_VERIFY_NUMERICS={backend.verify_numerics!r} needs --tp 1: exact mode "
                         "is not implemented under tensor parallelism")
    return ProcessSettings(**common, model=model_settings(environ), backend=backend, tp=tp_settings(environ),
                           topk=topk_diag_settings(environ))


# ---------------------------------------------------------------------------- value parsers
def _float(environ: Environ, name: str, default: float, high: float = MAX_TIMEOUT_S) -> float:
    """Seconds in [MIN_TIMEOUT_S, high] from `name`; `default` when unset. Raises ValueError
    naming the variable and value otherwise (empty, not a number, NaN, out of range)."""
    raw = environ.get(name)
    if raw is None:
        return default
    value = decimal(raw)
    if value is None:
        raise ValueError(f"{name}={short_repr(raw)}: not a number")
    if not MIN_TIMEOUT_S <= value <= high:
        raise ValueError(f"{name}={short_repr(raw)}: must be a number >= {MIN_TIMEOUT_S:g} and <= {high:.10g}")
    return value


# Counts travel as int32 in the wire messages (ModelIdentity.max_sessions): a larger value
# would pass here and then fail every Info call of the service that was given it.
INT32_MAX = 2**31 - 1
# A chunk longer than any prompt is one-shot prefill; past this it only delays decodes more.
MAX_PREFILL_CHUNK = 1 << 20


def _int(environ: Environ, name: str, default: int | None, low: int = 1, high: int = INT32_MAX) -> int | None:
    """An integer in [low, high] from `name`; `default` when unset. Raises ValueError naming the value."""
    raw = environ.get(name)
    if raw is None:
        return default
    digits = raw.strip()
    # The length check comes first: int() refuses more than 4300 digits with its own message,
    # which would not name the variable.
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 20 and low <= int(digits) <= high):
        raise ValueError(f"{name}={short_repr(raw)}: must be an integer >= {low} and <= {high}")
    return int(digits)


def _choice(environ: Environ, name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of `choices`, spelled exactly; `default` when unset. Raises ValueError naming the value."""
    raw = environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}={short_repr(raw)}: must be one of {choices}")
    return raw


def _switch(environ: Environ, name: str, default: bool) -> bool:
    """ "0" or "1" (spaces ignored); unset or empty is `default`. Raises ValueError naming the value."""
    raw = environ.get(name, "")
    value = raw.strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: must be 0 or 1")
    return value == "1"


def _port(environ: Environ, name: str, low: int) -> int | None:
    """A port in [low, 65535]; None when unset or empty. Raises ValueError naming the value."""
    raw = environ.get(name, "")
    text = raw.strip()
    if text == "":
        return None
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= 65535:
        raise ValueError(f"{name}={raw!r}: must be an integer in [{low}, 65535]")
    return int(text)


# ---------------------------------------------------------------------------- sections
def checkpoint(flag: str | None, environ: Environ) -> str | None:
    """The checkpoint folder: the flag, else DSPARK_CHECKPOINT, else None (built-in model)."""
    return flag or environ.get("DSPARK_CHECKPOINT") or None


def gateway_settings(environ: Environ) -> GatewaySettings:
    """Raises ValueError naming the variable and value when one is invalid (the token's value is never shown)."""
    drafter = environ.get("DSPARK_DRAFTER_TARGET", GatewaySettings.drafter_target)
    token = environ.get(TOKEN_VAR, "")
    if token and not valid_token(token):
        raise ValueError(f"{TOKEN_VAR}: must be printable ASCII without spaces (value not shown)")
    return GatewaySettings(
        verifier_target=backend_target(environ.get("DSPARK_VERIFIER_TARGET", GatewaySettings.verifier_target),
                                       "DSPARK_VERIFIER_TARGET"),
        drafter_target=backend_target(drafter, "DSPARK_DRAFTER_TARGET") if drafter.strip() else "",
        verify_mode=_choice(environ, "DSPARK_VERIFY_MODE", GatewaySettings.verify_mode, VERIFY_MODES),
        cost_mode=_choice(environ, "DSPARK_GATE_COSTS", DEFAULT_COST_MODE, COST_MODES),
        round_timeout_s=_float(environ, "DSPARK_ROUND_TIMEOUT_S", GatewaySettings.round_timeout_s),
        generation_timeout_s=_float(environ, "DSPARK_GENERATION_TIMEOUT_S", GatewaySettings.generation_timeout_s),
        startup_timeout_s=_float(environ, "DSPARK_STARTUP_TIMEOUT_S", GatewaySettings.startup_timeout_s),
        drafter_failovers=_int(environ, "DSPARK_DRAFTER_FAILOVERS", GatewaySettings.drafter_failovers, low=0),
        token=token, pinned_costs=tuple(f for f in PINNABLE_COSTS if GATE_ENV_VARS[f] in environ),
        sampling_rule=_choice(environ, "DSPARK_SAMPLING_RULE", GatewaySettings.sampling_rule, SAMPLING_RULES),
        load_aware=_switch(environ, "DSPARK_GATE_LOAD", True),
        regime=_switch(environ, "DSPARK_GATE_REGIME", True),
        warm_start=_switch(environ, "DSPARK_GATE_WARM_START", True),
        warm_max_weight=_warm_weight(environ))


def _warm_weight(environ: Environ) -> float:
    """DSPARK_GATE_WARM_WEIGHT (the gate settings' number rules); the default when unset.
    Raises ValueError naming the variable and value."""
    raw = environ.get("DSPARK_GATE_WARM_WEIGHT")
    if raw is None:
        return DEFAULT_MAX_WEIGHT
    return parse_warm_start(raw, "DSPARK_GATE_WARM_WEIGHT").max_weight


def client_token(flag: str | None, environ: Environ) -> tuple[str, str]:
    """`dspark generate`'s bearer token and where it came from: (token, "--token") when the
    flag is given, else (DSPARK_GATEWAY_TOKEN or "", "DSPARK_GATEWAY_TOKEN"). Unchecked: the
    caller reports a bad one naming its source."""
    return (flag, "--token") if flag is not None else (environ.get(TOKEN_VAR, ""), TOKEN_VAR)


def gate_config(environ: Environ) -> GateConfig:
    """The gate from DEEPSEEK_DSPARK_GATE*; unset variables keep GateConfig's defaults.

    DEEPSEEK_DSPARK_GATE_MARGIN_THRESHOLD may also be `auto` (any case): the pre-draft
    threshold is learned (GateConfig.margin_auto). Raises ValueError naming the variable and its
    value when a value does not parse (`parse_setting`: ASCII decimal forms only) or is out of
    range. An empty value is invalid.
    """
    values = {field: environ[var] for field, var in GATE_ENV_VARS.items() if var in environ}
    auto = values.get("margin_threshold", "").strip(" \t\r\n").lower() == "auto"
    if auto:  # the learned pre-draft threshold (docs/gate.md §6); the fixed one stays off
        del values["margin_threshold"]
    return GateConfig(**{field: parse_setting(field, raw, GATE_ENV_VARS[field]) for field, raw in values.items()},
                      margin_auto=auto)


def backend_settings(environ: Environ, device_flag: str | None = None) -> BackendSettings:
    """device_flag: `--device`, which wins over DSPARK_DEVICE. Raises ValueError naming the
    variable (or flag) and value when one is invalid."""
    if device_flag is not None:
        device = parse_device(device_flag, "--device")
    else:
        device = parse_device(environ.get("DSPARK_DEVICE", "cpu"), "DSPARK_DEVICE")
    return BackendSettings(device=device,
                           max_sessions=_int(environ, "DSPARK_MAX_SESSIONS", None),
                           prefill_chunk=_int(environ, "DSPARK_PREFILL_CHUNK", BackendSettings.prefill_chunk,
                                              high=MAX_PREFILL_CHUNK),
                           verify_mode=_choice(environ, "DSPARK_VERIFY_MODE", BackendSettings.verify_mode,
                                               VERIFY_MODES),
                           verify_numerics=_choice(environ, "DSPARK_VERIFY_NUMERICS", BackendSettings.verify_numerics,
                                                   VERIFY_NUMERICS),
                           step_profile=_switch(environ, "DSPARK_STEP_PROFILE", True),
                           step_gather_ms=_int(environ, "DSPARK_STEP_GATHER_MS", DEFAULT_STEP_GATHER_MS, low=0,
                                               high=MAX_STEP_GATHER_MS),
                           torch_threads=_int(environ, "DSPARK_TORCH_THREADS", DEFAULT_TORCH_THREADS, low=1,
                                              high=MAX_TORCH_THREADS))


def serve_settings(environ: Environ) -> ServeSettings:
    """Raises ValueError naming the variable and value when one is invalid."""
    return ServeSettings(health_port=_port(environ, "DSPARK_HEALTH_PORT", low=1),
                         drain_timeout_s=_float(environ, "DSPARK_DRAIN_TIMEOUT_S", ServeSettings.drain_timeout_s),
                         max_connection_age_s=_float(environ, "DSPARK_MAX_CONNECTION_AGE_S",
                                                     ServeSettings.max_connection_age_s, high=MAX_CONNECTION_AGE_S))


def metrics_port(flag: int | None, environ: Environ) -> int | None:
    """A service's Prometheus port: the flag, else DSPARK_METRICS_PORT, else None (no
    endpoint); 0 = any free port. Raises ValueError naming the flag or the variable and the
    value outside [0, 65535]."""
    if flag is not None:
        if not 0 <= flag <= 65535:
            raise ValueError(f"--metrics-port={flag}: must be in [0, 65535]")
        return flag
    return _port(environ, "DSPARK_METRICS_PORT", low=0)


def http_port(flag: int | None, environ: Environ, gateway_tls: bool = False) -> int | None:
    """The port of the gateway's OpenAI-compatible HTTP front: the flag, else DSPARK_HTTP_PORT,
    else None (no HTTP front); 0 = any free port, logged.

    Raises:
        ValueError: naming the flag or the variable and the value outside [0, 65535]; an HTTP
            port together with gateway TLS (the front reaches the gateway over a plaintext
            loopback channel and serves plain HTTP: terminate TLS in front of it instead).
    """
    if flag is not None:
        if not 0 <= flag <= 65535:
            raise ValueError(f"--http-port={flag}: must be in [0, 65535]")
        port, name = flag, "--http-port"
    else:
        port, name = _port(environ, "DSPARK_HTTP_PORT", low=0), "DSPARK_HTTP_PORT"
    if port is not None and gateway_tls:
        raise ValueError(f"{name}={port} with DSPARK_GATEWAY_TLS_CERT: the HTTP front serves plain HTTP; "
                         "terminate TLS in a proxy in front of it, or leave the HTTP port unset")
    return port


def log_format(environ: Environ) -> str:
    """DSPARK_LOG_FORMAT: "text" (unset or empty) or "json" (ignoring case and spaces).
    Raises ValueError naming the value otherwise."""
    raw = environ.get("DSPARK_LOG_FORMAT", "")
    value = raw.strip().lower() or "text"
    if value not in LOG_FORMATS:
        raise ValueError(f"DSPARK_LOG_FORMAT={raw!r}: must be one of {LOG_FORMATS}")
    return value


def model_settings(environ: Environ) -> ModelSettings:
    """The model's numerics switches (unset or empty = default; DSV4_KERNELS ignores case and spaces).

    Raises:
        ValueError: naming the variable and its value when a switch is not "0" or "1", or
            DSV4_KERNELS is not one of KERNEL_BACKENDS.
    """
    raw = environ.get(ENV_KERNELS, "")
    kernels = raw.strip().lower() or ModelSettings.kernels
    if kernels not in KERNEL_BACKENDS:
        raise ValueError(f"{ENV_KERNELS}={raw!r}: must be one of {', '.join(KERNEL_BACKENDS)}")
    return ModelSettings(moe_deterministic_reduce=_switch(environ, ENV_MOE_DETERMINISTIC_REDUCE, True),
                         kernels=kernels, moe_multi_token_fp4=_switch(environ, ENV_MOE_MULTI_TOKEN_FP4, False))


def tp_settings(environ: Environ) -> TPSettings:
    """Tensor-parallel deadlines in seconds (unset or empty = default). Raises ValueError
    naming the variable and its value unless it is a decimal number in [MIN_TIMEOUT_S,
    MAX_TIMEOUT_S] (`_float`)."""
    from services.verifier.tp import ENV_CALL_TIMEOUT, ENV_INIT_TIMEOUT, TPSettings

    given = {name: raw for name in (ENV_INIT_TIMEOUT, ENV_CALL_TIMEOUT)
             if (raw := environ.get(name, "")).strip() != ""}
    return TPSettings(init_timeout_s=_float(given, ENV_INIT_TIMEOUT, TPSettings.init_timeout_s),
                      call_timeout_s=_float(given, ENV_CALL_TIMEOUT, TPSettings.call_timeout_s))


def topk_diag_settings(environ: Environ) -> TopKDiagSettings | None:
    """The verifier's top-k dumps, or None when DSV4_TOPK_DIAG is unset, empty or 0.

    Raises ValueError naming the variable and value: K not an integer in [0, 4096], or a
    DSV4_TOPK_DIAG_DIR that is not an existing directory.
    """
    raw = environ.get("DSV4_TOPK_DIAG", "").strip()
    if raw in ("", "0"):
        return None
    from services.verifier.topk_diag import MAX_K, TopKDiagSettings
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_K:
        raise ValueError(f"DSV4_TOPK_DIAG={environ['DSV4_TOPK_DIAG']!r}: must be an integer in [0, {MAX_K}] (0 = off)")
    folder = Path(environ.get("DSV4_TOPK_DIAG_DIR") or ".")
    if not folder.is_dir():
        raise ValueError(f"DSV4_TOPK_DIAG_DIR={str(folder)!r}: not an existing directory")
    return TopKDiagSettings(int(raw), folder)


def telemetry_settings(environ: Environ) -> TelemetrySettings:
    """Span exporters. Raises ValueError naming OTEL_TRACES_EXPORTER's value when it lists an
    exporter not in EXPORTERS."""
    raw = environ.get("OTEL_TRACES_EXPORTER", "none")
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    if any(n not in EXPORTERS for n in names):
        raise ValueError(f"OTEL_TRACES_EXPORTER={raw!r}: supported exporters are {EXPORTERS}")
    return TelemetrySettings(exporters=tuple(n for n in names if n != "none"),
                             jsonl_path=environ.get("DSPARK_TRACES_JSONL") or None,
                             service_name=environ.get("OTEL_SERVICE_NAME") or None)


def _given(environ: Environ, names: tuple[str, ...], what: str) -> bool:
    """Whether the group `names` is set (all of them) or not (none). Raises ValueError naming
    the ones set and the ones missing when only some are."""
    given = [n for n in names if environ.get(n)]
    if given and len(given) != len(names):
        missing = [n for n in names if n not in given]
        raise ValueError(f"{', '.join(given)} set without {', '.join(missing)}: {what}")
    return bool(given)


def tls_files(environ: Environ) -> TlsFiles | None:
    """mTLS files of a backend (server) or of the gateway (client); None when none is set.

    Raises:
        ValueError: only some of DSPARK_TLS_CERT / _KEY / _CA set, or a file that is unreadable,
            not PEM, or a key that does not match its certificate (variable and path named).
    """
    names = ("DSPARK_TLS_CERT", "DSPARK_TLS_KEY", "DSPARK_TLS_CA")
    if not _given(environ, names, "mTLS needs all three (certificate, key, CA), plaintext none"):
        return None
    cert, key, ca = (PemFile(n, environ[n]) for n in names)
    return load_tls(cert, key, ca, environ.get("DSPARK_TLS_SERVER_NAME") or None)


def gateway_tls_files(environ: Environ) -> TlsFiles | None:
    """Server-side TLS of the gateway's client port; None when not configured (plaintext).

    Raises:
        ValueError: only one of DSPARK_GATEWAY_TLS_CERT / _KEY set, or a bad file (named).
    """
    names = ("DSPARK_GATEWAY_TLS_CERT", "DSPARK_GATEWAY_TLS_KEY")
    if not _given(environ, names, "TLS needs both"):
        return None
    return load_tls(*(PemFile(n, environ[n]) for n in names))
