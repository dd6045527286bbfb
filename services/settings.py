"""The one reader of the process environment: every variable the project reads, parsed once.

Each entry point (`dspark serve|up|generate|replay`, `training/demo.py`) calls `read_settings`
(or one section reader) with `os.environ` and passes the typed objects down; nothing below
reads the environment. The objects live next to their users and validate themselves; the
variables are declared in `services.settings_vars` (name, type, default, range, readers,
effect; docs/settings.md is generated from them), and every read here goes through its
declaration (`lookup`, which also resolves deprecated names). Errors name the variable as set
and its value. Flags given win over variables. Sections a service does not use stay None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from dsv4.settings import Settings as ModelSettings
from services.common.settings import (HTTP_MAX_BODY_BYTES, LOG_FORMATS, PINNABLE_COSTS, BackendSettings,
                                      GatewaySettings, ServeSettings, parse_device,
                                      TelemetrySettings, backend_target, valid_token)
from services.common.tls import PemFile, TlsFiles, load_tls
from services.gateway.gate import GateConfig
from services.gateway.values import decimal, parse_setting, short_repr
from services.settings_vars import BY_NAME, Var, lookup, warn_removed

if TYPE_CHECKING:  # both import torch: loaded only by the sections that need them
    from services.verifier.topk_diag import TopKDiagSettings
    from services.verifier.tp import TPSettings

Environ = Mapping[str, str]
SERVICES = ("verifier", "drafter", "gateway")
TOKEN_VAR = "DSPARK_GATEWAY_TOKEN"
# GateConfig field -> its variable (the `gate.<field>` declarations)
GATE_VARS = {v.field.removeprefix("gate."): v for v in BY_NAME.values() if v.field.startswith("gate.")}


def var(name: str) -> Var:
    """The declaration of variable `name`. Raises KeyError for an undeclared name."""
    return BY_NAME[name]
# A served gateway prices rounds with costs measured on its own backends unless told otherwise
# (`GatewaySettings` itself defaults to "configured" for embeddings and tests).
DEFAULT_COST_MODE = "measured"


@dataclass(frozen=True)
class ProcessSettings:
    """Everything one `dspark serve <service>` process reads, parsed before any model loads.

    checkpoint: the model folder (None = the bundled or random tiny model); serve, telemetry
    and tls (mTLS files, None = plaintext) apply to every service. model, backend: verifier
    and drafter; tp, topk (None = no dumps): verifier; gateway, gate, gateway_tls (None =
    plaintext client port), http_port (None = no HTTP front), http_max_body_bytes: gateway. metrics_port (None = no
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
    http_max_body_bytes: int = HTTP_MAX_BODY_BYTES
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
    warn_removed(environ)
    common = dict(service=service, checkpoint=checkpoint(checkpoint_flag, environ),
                  serve=serve_settings(environ), telemetry=telemetry_settings(environ), tls=tls_files(environ),
                  metrics_port=metrics_port(metrics_port_flag, environ), log_format=log_format(environ))
    if service == "gateway":
        gateway_tls = gateway_tls_files(environ)
        return ProcessSettings(**common, gateway=gateway_settings(environ), gate=gate_config(environ),
                               gateway_tls=gateway_tls,
                               http_port=http_port(http_port_flag, environ, gateway_tls is not None),
                               http_max_body_bytes=_int(environ, var("DSPARK_HTTP_MAX_BODY_BYTES")))
    backend = backend_settings(environ, device_flag)
    if service == "drafter":
        return ProcessSettings(**common, model=model_settings(environ), backend=backend)
    if tp > 1 and backend.verify_numerics != "fast":  # what `app.load_trunk` refuses, before it loads
        raise ValueError(f"DSPARK_VERIFY_NUMERICS={backend.verify_numerics!r} needs --tp 1: exact mode "
                         "is not implemented under tensor parallelism")
    return ProcessSettings(**common, model=model_settings(environ), backend=backend, tp=tp_settings(environ),
                           topk=topk_diag_settings(environ))


# ---------------------------------------------------------------------------- value parsers
def _seconds(environ: Environ, v: Var, empty_is_unset: bool = False) -> float:
    """Seconds in [v.low, v.high] from `v`; v.default when unset (or empty, with
    `empty_is_unset`). Raises ValueError naming the variable and value otherwise (empty, not a
    number, NaN, out of range)."""
    name, raw = lookup(environ, v)
    if raw is None or (empty_is_unset and raw.strip() == ""):
        return v.default
    value = decimal(raw)
    if value is None:
        raise ValueError(f"{name}={short_repr(raw)}: not a number")
    if not v.low <= value <= v.high:
        raise ValueError(f"{name}={short_repr(raw)}: must be a number >= {v.low:g} and <= {v.high:.10g}")
    return value


def _int(environ: Environ, v: Var) -> int | None:
    """An integer in [v.low, v.high] from `v`; v.default when unset. Raises ValueError naming the value."""
    name, raw = lookup(environ, v)
    if raw is None:
        return v.default
    digits = raw.strip()
    # The length check comes first: int() refuses more than 4300 digits with its own message,
    # which would not name the variable.
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 20 and v.low <= int(digits) <= v.high):
        raise ValueError(f"{name}={short_repr(raw)}: must be an integer >= {v.low} and <= {v.high}")
    return int(digits)


def _choice(environ: Environ, v: Var, fold: bool = False) -> str:
    """One of v.choices, spelled exactly (`fold`: case and spaces ignored, empty = default);
    v.default when unset. Raises ValueError naming the value."""
    name, raw = lookup(environ, v)
    if raw is None:
        return v.default
    value = (raw.strip().lower() or v.default) if fold else raw
    if value not in v.choices:
        raise ValueError(f"{name}={short_repr(raw)}: must be one of {v.choices}")
    return value


def _switch(environ: Environ, v: Var) -> bool:
    """ "0" or "1" (spaces ignored); unset or empty is v.default. Raises ValueError naming the value."""
    name, raw = lookup(environ, v)
    value = (raw or "").strip()
    if value == "":
        return v.default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: must be 0 or 1")
    return value == "1"


def _port(environ: Environ, v: Var) -> int | None:
    """A port in [v.low, v.high]; None when unset or empty. Raises ValueError naming the value."""
    name, raw = lookup(environ, v)
    text = (raw or "").strip()
    if text == "":
        return None
    if not (text.isascii() and text.isdigit()) or not v.low <= int(text) <= v.high:
        raise ValueError(f"{name}={raw!r}: must be an integer in [{v.low}, {v.high}]")
    return int(text)


def _text(environ: Environ, v: Var) -> str | None:
    """The value of `v`; None when unset or empty."""
    return lookup(environ, v)[1] or None


# ---------------------------------------------------------------------------- sections
def checkpoint(flag: str | None, environ: Environ) -> str | None:
    """The checkpoint folder: the flag, else DSPARK_CHECKPOINT, else None (built-in model)."""
    return flag or _text(environ, var("DSPARK_CHECKPOINT"))


def _target(environ: Environ, name: str, optional: bool) -> str:
    """A gateway backend target (`backend_target`); "" when `optional` and set empty. Raises
    ValueError naming the variable and value."""
    given, raw = lookup(environ, var(name))
    raw = var(name).default if raw is None else raw
    return backend_target(raw, given) if raw.strip() or not optional else ""


def gateway_settings(environ: Environ) -> GatewaySettings:
    """The gateway's settings as served: measured costs, the regime and warm starts on.
    Raises ValueError naming the variable and value when one is invalid (the token's value is never shown)."""
    token = _text(environ, var(TOKEN_VAR)) or ""
    if token and not valid_token(token):
        raise ValueError(f"{TOKEN_VAR}: must be printable ASCII without spaces (value not shown)")
    return GatewaySettings(
        verifier_target=_target(environ, "DSPARK_VERIFIER_TARGET", optional=False),
        drafter_target=_target(environ, "DSPARK_DRAFTER_TARGET", optional=True),
        verify_mode=_choice(environ, var("DSPARK_VERIFY_MODE")),
        cost_mode=_choice(environ, var("DSPARK_GATE_COSTS")),
        round_timeout_s=_seconds(environ, var("DSPARK_ROUND_TIMEOUT_S")),
        generation_timeout_s=_seconds(environ, var("DSPARK_GENERATION_TIMEOUT_S")),
        startup_timeout_s=_seconds(environ, var("DSPARK_STARTUP_TIMEOUT_S")),
        drafter_failovers=_int(environ, var("DSPARK_DRAFTER_FAILOVERS")), token=token,
        pinned_costs=tuple(f for f in PINNABLE_COSTS if lookup(environ, GATE_VARS[f])[1] is not None),
        sampling_rule=_choice(environ, var("DSPARK_SAMPLING_RULE")),
        regime=True, warm_start=True, step_budget=_choice(environ, var("DSPARK_STEP_BUDGET")))


def client_token(flag: str | None, environ: Environ) -> tuple[str, str]:
    """`dspark generate`'s bearer token and where it came from: (token, "--token") when the
    flag is given, else (DSPARK_GATEWAY_TOKEN or "", "DSPARK_GATEWAY_TOKEN"). Unchecked: the
    caller reports a bad one naming its source."""
    return (flag, "--token") if flag is not None else (_text(environ, var(TOKEN_VAR)) or "", TOKEN_VAR)


def gate_config(environ: Environ) -> GateConfig:
    """The gate from the DSPARK_GATE* variables; unset variables keep GateConfig's defaults.

    Raises ValueError naming the variable and its value when
    a value does not parse (`parse_setting`: ASCII decimal forms only) or is out of range. An
    empty value is invalid.
    """
    given = {field: lookup(environ, v) for field, v in GATE_VARS.items()}
    values = {field: (name, raw) for field, (name, raw) in given.items() if raw is not None}
    return GateConfig(**{field: parse_setting(field, raw, name) for field, (name, raw) in values.items()})


def backend_settings(environ: Environ, device_flag: str | None = None) -> BackendSettings:
    """A backend's settings as served (start-up step profile on). device_flag: `--device`, which
    wins over DSPARK_DEVICE. Raises ValueError naming the variable (or flag) and value when one
    is invalid."""
    if device_flag is not None:
        device = parse_device(device_flag, "--device")
    else:
        name, raw = lookup(environ, var("DSPARK_DEVICE"))
        device = parse_device("cpu" if raw is None else raw, name)
    return BackendSettings(device=device, max_sessions=_int(environ, var("DSPARK_MAX_SESSIONS")),
                           prefill_chunk=_int(environ, var("DSPARK_PREFILL_CHUNK")),
                           verify_mode=_choice(environ, var("DSPARK_VERIFY_MODE")),
                           verify_numerics=_choice(environ, var("DSPARK_VERIFY_NUMERICS")),
                           step_profile=True, step_gather_ms=_int(environ, var("DSPARK_STEP_GATHER_MS")),
                           step_alignment=_choice(environ, var("DSPARK_STEP_ALIGNMENT")),
                           torch_threads=_int(environ, var("DSPARK_TORCH_THREADS")))


def serve_settings(environ: Environ) -> ServeSettings:
    """Raises ValueError naming the variable and value when one is invalid."""
    return ServeSettings(health_port=_port(environ, var("DSPARK_HEALTH_PORT")),
                         drain_timeout_s=_seconds(environ, var("DSPARK_DRAIN_TIMEOUT_S")),
                         max_connection_age_s=_seconds(environ, var("DSPARK_MAX_CONNECTION_AGE_S")))


def _flag_port(flag: int, name: str) -> int:
    """A port flag's value. Raises ValueError naming the flag outside [0, 65535]."""
    if not 0 <= flag <= 65535:
        raise ValueError(f"{name}={flag}: must be in [0, 65535]")
    return flag


def metrics_port(flag: int | None, environ: Environ) -> int | None:
    """A service's Prometheus port: the flag, else DSPARK_METRICS_PORT, else None (no
    endpoint); 0 = any free port. Raises ValueError naming the flag or the variable and the
    value outside [0, 65535]."""
    if flag is not None:
        return _flag_port(flag, "--metrics-port")
    return _port(environ, var("DSPARK_METRICS_PORT"))


def http_port(flag: int | None, environ: Environ, gateway_tls: bool = False) -> int | None:
    """The port of the gateway's OpenAI-compatible HTTP front: the flag, else DSPARK_HTTP_PORT,
    else None (no HTTP front); 0 = any free port, logged.

    Raises:
        ValueError: naming the flag or the variable and the value outside [0, 65535]; an HTTP
            port together with gateway TLS (the front reaches the gateway over a plaintext
            loopback channel and serves plain HTTP: terminate TLS in front of it instead).
    """
    if flag is not None:
        port, name = _flag_port(flag, "--http-port"), "--http-port"
    else:
        port, name = _port(environ, var("DSPARK_HTTP_PORT")), "DSPARK_HTTP_PORT"
    if port is not None and gateway_tls:
        raise ValueError(f"{name}={port} with DSPARK_GATEWAY_TLS_CERT: the HTTP front serves plain HTTP; "
                         "terminate TLS in a proxy in front of it, or leave the HTTP port unset")
    return port


def log_format(environ: Environ) -> str:
    """DSPARK_LOG_FORMAT: "text" (unset or empty) or "json" (ignoring case and spaces).
    Raises ValueError naming the value otherwise."""
    name, raw = lookup(environ, var("DSPARK_LOG_FORMAT"))
    value = (raw or "").strip().lower() or "text"
    if value not in LOG_FORMATS:
        raise ValueError(f"{name}={raw!r}: must be one of {LOG_FORMATS}")
    return value


def model_settings(environ: Environ) -> ModelSettings:
    """The model's numerics switches (unset or empty = default; DSPARK_KERNELS ignores case and spaces).

    Raises:
        ValueError: naming the variable and its value when a switch is not "0" or "1", or
            DSPARK_KERNELS is not one of KERNEL_BACKENDS.
    """
    kernels = var("DSPARK_KERNELS")
    name, raw = lookup(environ, kernels)
    value = (raw or "").strip().lower() or kernels.default
    if value not in kernels.choices:
        raise ValueError(f"{name}={raw!r}: must be one of {', '.join(kernels.choices)}")
    return ModelSettings(moe_deterministic_reduce=_switch(environ, var("DSPARK_MOE_DETERMINISTIC_REDUCE")),
                         kernels=value, moe_multi_token_fp4=_switch(environ, var("DSPARK_MOE_MULTI_TOKEN_FP4")))


def tp_settings(environ: Environ) -> TPSettings:
    """Tensor-parallel deadlines in seconds (unset or empty = default). Raises ValueError
    naming the variable and its value unless it is a decimal number in [MIN_TIMEOUT_S,
    MAX_TIMEOUT_S] (`_seconds`)."""
    from services.verifier.tp import TPSettings

    return TPSettings(init_timeout_s=_seconds(environ, var("DSPARK_TP_INIT_TIMEOUT_S"), empty_is_unset=True),
                      call_timeout_s=_seconds(environ, var("DSPARK_TP_CALL_TIMEOUT_S"), empty_is_unset=True))


def topk_diag_settings(environ: Environ) -> TopKDiagSettings | None:
    """The verifier's top-k dumps, or None when DSPARK_TOPK_DIAG is unset, empty or 0.

    Raises ValueError naming the variable and value: K not an integer in [0, 4096], or a
    DSPARK_TOPK_DIAG_DIR that is not an existing directory.
    """
    k_var, dir_var = var("DSPARK_TOPK_DIAG"), var("DSPARK_TOPK_DIAG_DIR")
    name, raw = lookup(environ, k_var)
    dir_name, dir_raw = lookup(environ, dir_var)
    text = (raw or "").strip()
    if text in ("", "0"):
        return None
    from services.verifier.topk_diag import TopKDiagSettings
    if not (text.isascii() and text.isdigit()) or int(text) > k_var.high:
        raise ValueError(f"{name}={raw!r}: must be an integer in [0, {k_var.high}] (0 = off)")
    folder = Path(dir_raw or dir_var.default)
    if not folder.is_dir():
        raise ValueError(f"{dir_name}={str(folder)!r}: not an existing directory")
    return TopKDiagSettings(int(text), folder)


def telemetry_settings(environ: Environ) -> TelemetrySettings:
    """Span exporters. Raises ValueError naming OTEL_TRACES_EXPORTER's value when it lists an
    exporter not in EXPORTERS."""
    exporters = var("OTEL_TRACES_EXPORTER")
    raw = lookup(environ, exporters)[1]
    raw = exporters.default if raw is None else raw
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    if any(n not in exporters.choices for n in names):
        raise ValueError(f"OTEL_TRACES_EXPORTER={raw!r}: supported exporters are {exporters.choices}")
    return TelemetrySettings(exporters=tuple(n for n in names if n != "none"),
                             jsonl_path=_text(environ, var("DSPARK_TRACES_JSONL")),
                             service_name=_text(environ, var("OTEL_SERVICE_NAME")))


def _given(environ: Environ, names: tuple[str, ...], what: str) -> dict[str, str]:
    """The group `names` as {name: value} when all are set, {} when none is. Raises ValueError
    naming the ones set and the ones missing when only some are."""
    values = {n: _text(environ, var(n)) for n in names}
    given = [n for n in names if values[n]]
    if given and len(given) != len(names):
        missing = [n for n in names if n not in given]
        raise ValueError(f"{', '.join(given)} set without {', '.join(missing)}: {what}")
    return values if given else {}


def tls_files(environ: Environ) -> TlsFiles | None:
    """mTLS files of a backend (server) or of the gateway (client); None when none is set.

    Raises:
        ValueError: only some of DSPARK_TLS_CERT / _KEY / _CA set, or a file that is unreadable,
            not PEM, or a key that does not match its certificate (variable and path named).
    """
    server_name = _text(environ, var("DSPARK_TLS_SERVER_NAME"))
    files = _given(environ, ("DSPARK_TLS_CERT", "DSPARK_TLS_KEY", "DSPARK_TLS_CA"),
                   "mTLS needs all three (certificate, key, CA), plaintext none")
    if not files:
        return None
    cert, key, ca = (PemFile(n, path) for n, path in files.items())
    return load_tls(cert, key, ca, server_name)


def gateway_tls_files(environ: Environ) -> TlsFiles | None:
    """Server-side TLS of the gateway's client port; None when not configured (plaintext).

    Raises:
        ValueError: only one of DSPARK_GATEWAY_TLS_CERT / _KEY set, or a bad file (named).
    """
    files = _given(environ, ("DSPARK_GATEWAY_TLS_CERT", "DSPARK_GATEWAY_TLS_KEY"), "TLS needs both")
    if not files:
        return None
    return load_tls(*(PemFile(n, path) for n, path in files.items()))
