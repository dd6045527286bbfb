"""Every environment variable the project reads, declared once.

Each `Var` gives a variable's name, type, served default, valid range, the processes that
read it, what it changes, and its deprecated old names. `services.settings` parses the
environment only through these declarations (`lookup`), and `python -m services.settings_doc`
writes docs/settings.md (and the README's six key settings) from them; tests fail when that
file is stale or when a parser reads a variable not declared here. A new setting is one `Var`
in `VARS`, its read in `services.settings`, then `make settings-doc`.

One prefix, `DSPARK_`, for the project's own variables. Two others are kept, because their
names belong to other projects: `OTEL_*` (OpenTelemetry's standard names, which its SDK and
every collector's documentation use) and `TRITON_INTERPRET` (Triton's own switch, read by
triton itself; `kernels.checks` only asks whether it is set). The old `DEEPSEEK_DSPARK_GATE*`,
`DSV4_*` and `DEEPSEEK_GPU_*` names still work as deprecated aliases: the first read of one
in a process logs one warning naming its replacement.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Mapping

from dsv4.settings import (ENV_KERNELS, ENV_MOE_DETERMINISTIC_REDUCE, ENV_MOE_MULTI_TOKEN_FP4, KERNEL_BACKENDS,
                           Settings as ModelSettings)
from services.common.settings import (COST_MODES, DEFAULT_MAX_CONNECTION_AGE_S, DEFAULT_STEP_GATHER_MS,
                                      HTTP_MAX_BODY_BYTES,
                                      DEFAULT_TORCH_THREADS, EXPORTERS, LOG_FORMATS, MAX_CONNECTION_AGE_S,
                                      MAX_STEP_GATHER_MS, MAX_TIMEOUT_S, MAX_TORCH_THREADS, MIN_TIMEOUT_S,
                                      SAMPLING_RULES, STEP_ALIGNMENTS, STEP_BUDGETS, VERIFY_MODES, VERIFY_NUMERICS, BackendSettings,
                                      GatewaySettings, ServeSettings)
from services.gateway.gate import ENV_VARS as GATE_ENV_VARS, GateConfig
from services.gateway.values import rule_text

log = logging.getLogger(__name__)

# Who reads a variable: the three services, and `dspark generate` (the gateway's client).
READERS = ("verifier", "drafter", "gateway", "generate")
ALL = ("verifier", "drafter", "gateway")
BACKENDS = ("verifier", "drafter")
# Counts travel as int32 in the wire messages (ModelIdentity.max_sessions): a larger value
# would pass here and then fail every Info call of the service that was given it.
INT32_MAX = 2**31 - 1
# A chunk longer than any prompt is one-shot prefill; past this it only delays decodes more.
MAX_PREFILL_CHUNK = 1 << 20
MAX_TOPK = 4096  # services.verifier.topk_diag.MAX_K (a test checks the two agree)
# The type column of docs/settings.md, per kind.
KINDS = {"seconds": "seconds", "integer": "integer", "choice": "choice", "switch": "0 or 1",
         "port": "port", "number": "number", "text": "text", "path": "path", "target": "gRPC target",
         "list": "comma-separated list"}


@dataclass(frozen=True)
class Var:
    """One environment variable.

    name: the variable (`DSPARK_...`). kind: a key of KINDS. default: the value a served
    process uses when the variable is unset (None: off, or computed: see `shown_default`).
    readers: the processes that read it (READERS). effect: what it changes, one sentence or
    two of Markdown. low, high: bounds of a number (inclusive); choices: the accepted words.
    shown_default / shown_range: text for the reference where the value alone would mislead.
    aliases: deprecated old names, still read. field: the settings field it fills (docs only,
    e.g. "gateway.round_timeout_s"). key: one of the README's six settings that change behaviour.
    group: the reference's section.
    """

    name: str
    kind: str
    default: object
    readers: tuple[str, ...]
    effect: str
    group: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    shown_default: str = ""
    shown_range: str = ""
    aliases: tuple[str, ...] = ()
    field: str = ""
    key: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind={self.kind!r} is not one of {sorted(KINDS)}")
        if not self.readers or any(r not in READERS for r in self.readers):
            raise ValueError(f"{self.name}: readers={self.readers!r} must name some of {READERS}")

    def default_text(self) -> str:
        """The default as the reference shows it."""
        if self.shown_default:
            return self.shown_default
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)

    def range_text(self) -> str:
        """The valid values as the reference shows them."""
        if self.shown_range:
            return self.shown_range
        if self.choices:
            return ", ".join(self.choices)
        if self.kind == "switch":
            return "0, 1"
        if self.low is not None and self.high is not None:
            return f"[{self.low:g}, {self.high:.10g}]"
        return ""


def _gate(field: str, effect: str, **extra) -> Var:
    """A gate variable: GateConfig `field`, its name (gate.ENV_VARS), default and rule
    (`services.gateway.values`); its deprecated name is the old DEEPSEEK_ prefixed one."""
    kind = "switch" if field == "enabled" else "number"
    return Var(GATE_ENV_VARS[field], kind, getattr(GateConfig, field), ("gateway",), effect, "gate",
               aliases=("DEEPSEEK_" + GATE_ENV_VARS[field],), shown_range=rule_text(field), field=f"gate.{field}", **extra)


def _secs(name: str, default: float, readers: tuple[str, ...], effect: str, group: str,
          high: float = MAX_TIMEOUT_S, **extra) -> Var:
    return Var(name, "seconds", default, readers, effect, group, low=MIN_TIMEOUT_S, high=high, **extra)


VARS: tuple[Var, ...] = (
    # ---- model and process
    Var("DSPARK_CHECKPOINT", "path", None, ALL, "The checkpoint folder the services load; unset: a fixed random "
        "tiny model (docs/model.md §13). `--checkpoint` wins.", "process",
        shown_default="unset (random tiny model)", field="checkpoint", key=True),
    Var("DSPARK_MAX_SESSIONS", "integer", None, BACKENDS, "Concurrent sessions (one per generation) a backend "
        "admits; one more is refused at once with RESOURCE_EXHAUSTED (HTTP 429). Unset: min(256, 0.5 x "
        "MemAvailable / one session's state bytes), reported in Info.", "process", low=1, high=INT32_MAX,
        shown_default="sized from memory", field="backend.max_sessions", key=True),
    Var("DSPARK_TORCH_THREADS", "integer", DEFAULT_TORCH_THREADS, BACKENDS, "Torch intra-op threads of every "
        "thread that runs the model (one is fastest for the bundled model; a large model on many cores "
        "wants more).", "process", low=1, high=MAX_TORCH_THREADS, field="backend.torch_threads"),
    Var(ENV_KERNELS, "choice", ModelSettings.kernels, BACKENDS, "Implementation of the `kernels/` ops: "
        "the plain-torch references or the Triton kernels (CUDA, or CPU under `TRITON_INTERPRET=1`).",
        "process", choices=KERNEL_BACKENDS, aliases=("DSV4_KERNELS",), field="model.kernels"),
    Var(ENV_MOE_DETERMINISTIC_REDUCE, "switch", ModelSettings.moe_deterministic_reduce, BACKENDS,
        "1 sums a token's routed-expert outputs in ascending expert id, so the MoE output does not depend on "
        "routing order; 0 sums them in routing order.", "process", aliases=("DSV4_MOE_DETERMINISTIC_REDUCE",),
        field="model.moe_deterministic_reduce"),
    Var(ENV_MOE_MULTI_TOKEN_FP4, "switch", ModelSettings.moe_multi_token_fp4, BACKENDS, "1 runs "
        "multi-token fp4 routed-expert GEMMs (verify) on the small-batch path instead of the grouped one "
        "(GPU).", "process", aliases=("DEEPSEEK_GPU_MOE_MULTI_TOKEN_FP4",), field="model.moe_multi_token_fp4"),
    # ---- verifier
    Var("DSPARK_VERIFY_NUMERICS", "choice", BackendSettings.verify_numerics, ("verifier",), "`exact` makes "
        "every forward use fixed shapes, so batched verify is bitwise equal to plain decode (TP 1 only; it "
        "costs CPU, bench/README.md); `fast` lets GEMM shapes vary.", "verifier", choices=VERIFY_NUMERICS,
        field="backend.verify_numerics", key=True),
    Var("DSPARK_VERIFY_MODE", "choice", BackendSettings.verify_mode, ("verifier", "gateway"), "How a draft "
        "block is verified: one forward per token (`sequential`) or one forward of the block plus rollback "
        "(`batched`).", "verifier", choices=VERIFY_MODES, field="gateway.verify_mode, backend.verify_mode"),
    Var("DSPARK_DEVICE", "choice", "cpu", BACKENDS, "Where the verifier's or drafter's model runs: "
        "`cpu`, `cuda` or `cuda:N` (`--device` wins; TP > 1 puts rank r on `cuda:r`; bf16 on a GPU). A missing "
        "device fails at start-up, naming it.", "verifier", shown_range="cpu, cuda, cuda:N", field="backend.device"),
    Var("DSPARK_PREFILL_CHUNK", "integer", BackendSettings.prefill_chunk, ("verifier",), "The most prompt "
        "tokens one verifier step forwards (chunked prefill): a running generation waits at most one chunk.",
        "verifier", low=1, high=MAX_PREFILL_CHUNK, field="backend.prefill_chunk"),
    Var("DSPARK_STEP_GATHER_MS", "integer", DEFAULT_STEP_GATHER_MS, BACKENDS, "The longest (ms) a verifier or "
        "drafter step waits for the sessions the previous step answered, never longer than that step took; "
        "0: no wait.", "verifier", low=0, high=MAX_STEP_GATHER_MS, field="backend.step_gather_ms"),
    Var("DSPARK_STEP_ALIGNMENT", "choice", BackendSettings.step_alignment, ("verifier",), "How the verifier's "
        "steps gather sessions: `auto` (`rate` on a GPU, `gather` on a CPU), `gather` (wait for the sessions the last step answered that turn straight "
        "around), `free` (never wait), `lockstep` (wait for every session, drafting ones included), `pingpong` "
        "(two cohorts take turns) or `rate` "
        "(wait for the arrivals that maximise sessions per step ms on the step table); docs/simulate.md §6.",
        "verifier", choices=STEP_ALIGNMENTS, field="backend.step_alignment"),
    _secs("DSPARK_TP_INIT_TIMEOUT_S", 600.0, ("verifier",), "Deadline of tensor-parallel start-up: every rank "
          "joins the process group and loads its shard.", "verifier", aliases=("DSV4_TP_INIT_TIMEOUT_S",),
          field="tp.init_timeout_s"),
    _secs("DSPARK_TP_CALL_TIMEOUT_S", 120.0, ("verifier",), "Deadline of one tensor-parallel call; a dead or "
          "stalled rank is an error, never a hang.", "verifier", aliases=("DSV4_TP_CALL_TIMEOUT_S",),
          field="tp.call_timeout_s"),
    Var("DSPARK_TOPK_DIAG", "integer", 0, ("verifier",), "K >= 1: the verifier writes the top-K ids and logits "
        "of every forward, one file per TP rank, for `dspark parity` (slow: diagnosis only); 0: off.",
        "verifier", low=0, high=MAX_TOPK, aliases=("DSV4_TOPK_DIAG",), field="topk.k"),
    Var("DSPARK_TOPK_DIAG_DIR", "path", ".", ("verifier",), "The existing folder those dumps go to "
        "(`topk-rank{r}-pid{pid}.jsonl`).", "verifier", aliases=("DSV4_TOPK_DIAG_DIR",), field="topk.folder"),
    # ---- gateway
    Var("DSPARK_VERIFIER_TARGET", "target", GatewaySettings.verifier_target, ("gateway",), "The verifier(s): "
        "`host:port`, a list of IP `address:port`s, or any gRPC target such as `dns:///name:port` "
        "(round-robin).", "gateway", field="gateway.verifier_target"),
    Var("DSPARK_DRAFTER_TARGET", "target", GatewaySettings.drafter_target, ("gateway",), "The drafter(s), "
        "likewise; empty: no drafter, every generation plain decode.", "gateway",
        field="gateway.drafter_target"),
    Var("DSPARK_SAMPLING_RULE", "choice", GatewaySettings.sampling_rule, ("gateway",), "The acceptance rule of "
        "sampled requests that leave theirs unset: `coupled` (one output per seed, whatever the speculation) "
        "or `rejection` (lossless in distribution); docs/sampling.md.", "gateway", choices=SAMPLING_RULES,
        field="gateway.sampling_rule", key=True),
    Var("DSPARK_STEP_BUDGET", "choice", GatewaySettings.step_budget, ("gateway",), "How gated generations use "
        "the verifier's step budget: `off` (the gate chooses each length), `trim` (each verify carries its "
        "drafts' survival estimates and the verifier's step may cut it) or `full` (the step chooses every "
        "length); `trim` and `full` need DSPARK_VERIFY_MODE=batched; docs/gate.md §15.", "gateway",
        choices=STEP_BUDGETS, field="gateway.step_budget"),
    Var("DSPARK_DRAFTER_FAILOVERS", "integer", GatewaySettings.drafter_failovers, ("gateway",), "New drafter "
        "sessions a generation may re-prime after its drafter failed; 0: plain decode at once.", "gateway",
        low=0, high=INT32_MAX, field="gateway.drafter_failovers"),
    _secs("DSPARK_ROUND_TIMEOUT_S", GatewaySettings.round_timeout_s, ("gateway",), "Deadline of one backend "
          "reply.", "gateway", field="gateway.round_timeout_s"),
    _secs("DSPARK_GENERATION_TIMEOUT_S", GatewaySettings.generation_timeout_s, ("gateway",), "Deadline of one "
          "generation's backend streams.", "gateway", field="gateway.generation_timeout_s"),
    _secs("DSPARK_STARTUP_TIMEOUT_S", GatewaySettings.startup_timeout_s, ("gateway",), "How long the gateway "
          "waits at start for the backends' Info.", "gateway", field="gateway.startup_timeout_s"),
    Var("DSPARK_GATEWAY_TOKEN", "text", None, ("gateway", "generate"), "Bearer token every client call must "
        "carry (UNAUTHENTICATED otherwise); the token `dspark generate` sends (`--token` wins). Printable "
        "ASCII without spaces.", "gateway", field="gateway.token"),
    Var("DSPARK_GATEWAY_TLS_CERT", "path", None, ("gateway",), "TLS certificate chain of the client-facing "
        "port (with DSPARK_GATEWAY_TLS_KEY).", "gateway", field="gateway_tls"),
    Var("DSPARK_GATEWAY_TLS_KEY", "path", None, ("gateway",), "Its private key.", "gateway",
        field="gateway_tls"),
    Var("DSPARK_HTTP_PORT", "port", None, ("gateway",), "Port of the OpenAI-compatible HTTP front "
        "(`/v1/completions`, `/v1/chat/completions`); 0: any free port, logged; unset: no HTTP front. "
        "`--http-port` wins.", "gateway", low=0, high=65535, field="http_port"),
    Var("DSPARK_HTTP_MAX_BODY_BYTES", "integer", HTTP_MAX_BODY_BYTES, ("gateway",), "The HTTP front's request "
        "body limit in bytes; a larger body gets 413 without being read.", "gateway", low=1, high=2**40,
        field="http_max_body_bytes"),
    # ---- gate
    _gate("enabled", "1: the `default` spec mode is `gated` (the gate chooses each round's draft length); "
          "0: `always`.", key=True),
    _gate("margin_threshold", "Skip drafting when the anchor's top1 - top2 logit margin is below this; 0: "
          "off (docs/gate.md §5)."),
    _gate("win_factor", "A truncated draft is taken only if its expected tokens per ms beat the full block by "
          "this factor."),
    _gate("decay", "Forgetting per observed round of the acceptance estimates."),
    _gate("draft_ms", "Cost of one draft round (ms); setting it pins the cost (measured costs never replace "
          "it)."),
    _gate("verify_base_ms", "Verify cost, fixed part (ms); pins it likewise."),
    _gate("verify_slope_ms", "Verify cost per submitted draft token (ms); pins it likewise."),
    _gate("plain_ms", "One plain decode step (ms); pins it likewise."),
    Var("DSPARK_GATE_COSTS", "choice", "measured", ("gateway",), "Where the gate's costs come from: `measured` "
        "(profiled at start-up, refined from live rounds) or `configured` (the `DSPARK_GATE_*_MS` values "
        "and their defaults).", "gate", choices=COST_MODES, field="gateway.cost_mode", key=True),
    # ---- every service
    Var("DSPARK_HEALTH_PORT", "port", None, ALL, "A plaintext port serving only grpc.health.v1 (Kubernetes "
        "probes under mTLS).", "serve", low=1, high=65535, field="serve.health_port"),
    Var("DSPARK_METRICS_PORT", "port", None, ALL, "Prometheus `/metrics` port (0: any free port, logged); "
        "`--metrics-port` wins; docs/analysis.md §5.", "serve", low=0, high=65535, field="metrics_port"),
    _secs("DSPARK_DRAIN_TIMEOUT_S", ServeSettings.drain_timeout_s, ALL, "After SIGTERM (health NOT_SERVING "
          "first), how long open streams may finish.", "serve", field="serve.drain_timeout_s"),
    _secs("DSPARK_MAX_CONNECTION_AGE_S", DEFAULT_MAX_CONNECTION_AGE_S, ALL, "Clients reconnect after this "
          "(open streams go on), re-resolving `dns:///` targets.", "serve", high=MAX_CONNECTION_AGE_S,
          field="serve.max_connection_age_s"),
    Var("DSPARK_LOG_FORMAT", "choice", "text", ALL, "`json`: every log line, and each generation's request "
        "line, one JSON object. Case and spaces ignored.", "serve", choices=LOG_FORMATS, field="log_format"),
    Var("DSPARK_TLS_CERT", "path", None, ALL, "mTLS between gateway and backends: this process's certificate "
        "chain (with DSPARK_TLS_KEY and DSPARK_TLS_CA: all three or none).", "serve", field="tls"),
    Var("DSPARK_TLS_KEY", "path", None, ALL, "Its private key.", "serve", field="tls"),
    Var("DSPARK_TLS_CA", "path", None, ALL, "The CA it trusts.", "serve", field="tls"),
    Var("DSPARK_TLS_SERVER_NAME", "text", None, ALL, "The name the backends' certificates must carry when it is "
        "not the target's host (read by the gateway).", "serve", field="tls.server_name"),
    # ---- telemetry
    Var("DSPARK_TRACES_JSONL", "path", None, ALL, "Append every finished span as one JSON line to this "
        "file.", "telemetry", field="telemetry.jsonl_path"),
    Var("OTEL_TRACES_EXPORTER", "list", "none", ALL, "Span exporters; the standard `OTEL_EXPORTER_OTLP_*` "
        "variables configure `otlp` (read by the exporter itself).", "telemetry", choices=EXPORTERS,
        field="telemetry.exporters"),
    Var("OTEL_SERVICE_NAME", "text", None, ALL, "`service.name` on spans.", "telemetry",
        shown_default="dspark-<service>", field="telemetry.service_name"),
)

BY_NAME: dict[str, Var] = {v.name: v for v in VARS}
# Variables no longer read, each with where its job went; setting one logs one warning.
REMOVED: dict[str, str] = {
    "DSPARK_GATE_LOAD": "load pricing was removed: it won no simulator cell reproducibly "
                        "(bench/history/2026-12-07-load-pricing.md)",
    "DSPARK_GATE_REGIME": "the model regime (docs/gate.md §14) always runs (GatewaySettings.regime)",
    "DSPARK_GATE_WARM_START": "gated generations always warm-start (GatewaySettings.warm_start)",
    "DSPARK_GATE_WARM_WEIGHT": "the warm start lends at most services.gateway.warm.DEFAULT_MAX_WEIGHT",
    "DSPARK_STEP_PROFILE": "the verifier always profiles its steps at start-up (BackendSettings.step_profile)",
    "DSPARK_GATE_MIN_DRAFT": "no floor on submitted drafts: no measurement supported one (a probe verifies one draft)",
}
# The one variable kept outside the table: Triton's own switch (module docstring).
EXTERNAL = {"TRITON_INTERPRET": "Triton's own: 1 runs Triton kernels on the CPU interpreter (the test suite sets it)"}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(name: str, message: str) -> None:
    """Log `message` at WARNING the first time `name` is warned about in this process."""
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    log.warning(message)


def lookup(environ: Mapping[str, str], var: Var) -> tuple[str, str | None]:
    """(the name set, its raw value) of `var` in `environ`; (var.name, None) when unset.

    A deprecated alias counts when the new name is unset; its first use in the process logs
    one warning. Raises ValueError naming both when the new name and an alias are set to
    different values.
    """
    name, raw = var.name, environ.get(var.name)
    for old in var.aliases:
        old_raw = environ.get(old)
        if old_raw is None:
            continue
        _warn_once(old, f"{old} is deprecated: set {var.name} instead (same values); the old name will go")
        if raw is None:
            name, raw = old, old_raw
        elif old_raw != raw:
            raise ValueError(f"{var.name}={raw!r} and its deprecated alias {old}={old_raw!r} disagree: "
                             f"set only {var.name}")
    return name, raw


def warn_removed(environ: Mapping[str, str]) -> None:
    """Log one warning per process for each REMOVED variable set in `environ`."""
    for name, why in REMOVED.items():
        if name in environ:
            _warn_once(name, f"{name} is no longer read and has no effect: {why}")
