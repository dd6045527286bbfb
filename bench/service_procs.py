"""The three services as separate `dspark serve` processes, for the serving benchmark and the soak.

Owns starting one verifier, one drafter and one gateway as child processes of the caller
(`python -m services.cli serve <service>`, the entry point `dspark serve` runs), waiting
until the gateway reports SERVING on grpc.health.v1, sampling each process's resident set
size, and stopping them (SIGTERM, which drains, then SIGKILL after a deadline). It talks to
the services only through that public entry point and their gRPC API, so it keeps working
whatever the engines inside do. Ports: gateway port_base, verifier + 1, drafter + 2 (as
`dspark up --port-base`). Every child gets the caller's environment (`base_env`, read once
by the benchmark's entry point) with the settings of `StackSpec` laid over it.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.ports import check_ports_free

SERVICES = ("verifier", "drafter", "gateway")
REPO_ROOT = Path(__file__).resolve().parents[1]
# Variables that would make the three children fight over one port, or change what the
# benchmark measures behind its back; each child gets them from StackSpec or not at all.
_DROPPED_ENV = ("DSPARK_HTTP_PORT", "DSPARK_METRICS_PORT", "DSPARK_HEALTH_PORT", "DSPARK_GATE", "DEEPSEEK_DSPARK_GATE")


@dataclass(frozen=True)
class StackSpec:
    """What one stack of services runs.

    checkpoint: model folder every service loads (None: the random tiny model).
    port_base: gateway port; verifier port_base + 1, drafter + 2 (1..65533).
    verify_numerics: the verifier's DSPARK_VERIFY_NUMERICS, "fast" or "exact".
    max_sessions: DSPARK_MAX_SESSIONS of verifier and drafter (>= 1).
    threads: torch intra-op threads per process (OMP_NUM_THREADS, >= 1).
    log_dir: folder of each child's combined stdout/stderr (`<name>-<port>.log`).
    root: the source tree the children run (default this checkout; another tree lets a
        benchmark compare two versions of the code side by side).
    env: settings laid over the caller's environment last (e.g. DSPARK_STEP_GATHER_MS).
    tp: the verifier's `--tp` (>= 1; TP > 1 starts its worker ranks as well).
    record_rounds: the gateway's `--record-rounds` file (every round, written at its shutdown;
        None: not recorded).
    drafter_args: extra `dspark serve drafter` flags (e.g. `--oracle --oracle-corrupt-every 1`:
        the drafter a benchmark measures the gate against).
    Raises:
        ValueError: a field outside its range, named with its value.
    """

    checkpoint: str | None
    port_base: int
    log_dir: Path
    verify_numerics: str = "fast"
    max_sessions: int = 64
    threads: int = 1
    root: Path = REPO_ROOT
    env: tuple[tuple[str, str], ...] = ()
    tp: int = 1
    record_rounds: Path | None = None
    drafter_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp={self.tp}: must be >= 1")
        if not 1 <= self.port_base <= 65533:
            raise ValueError(f"port_base={self.port_base}: must be in [1, 65533] (the drafter listens on + 2)")
        if self.verify_numerics not in ("fast", "exact"):
            raise ValueError(f"verify_numerics={self.verify_numerics!r}: must be 'fast' or 'exact'")
        if self.max_sessions < 1 or self.threads < 1:
            raise ValueError(f"max_sessions={self.max_sessions}, threads={self.threads}: both must be >= 1")

    @property
    def ports(self) -> dict[str, int]:
        return {"gateway": self.port_base, "verifier": self.port_base + 1, "drafter": self.port_base + 2}

    @property
    def gateway_target(self) -> str:
        return f"127.0.0.1:{self.port_base}"

    @property
    def verifier_target(self) -> str:
        return f"127.0.0.1:{self.port_base + 1}"

    @property
    def drafter_target(self) -> str:
        return f"127.0.0.1:{self.port_base + 2}"


class ServiceProcesses:
    """One running stack: three child processes (see the module docstring).

    Raises (constructor):
        ValueError: a port of the stack is taken (named by `check_ports_free`).
        OSError: a child could not be started or its log not opened.
    """

    def __init__(self, spec: StackSpec, base_env: Mapping[str, str]):
        check_ports_free("127.0.0.1", {f"{n} (port-base {spec.port_base})": p for n, p in spec.ports.items()})
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.procs: dict[str, subprocess.Popen] = {}
        env = {k: v for k, v in base_env.items() if k not in _DROPPED_ENV}
        env.update(DSPARK_VERIFY_NUMERICS=spec.verify_numerics, DSPARK_MAX_SESSIONS=str(spec.max_sessions),
                   DSPARK_VERIFIER_TARGET=spec.verifier_target, DSPARK_DRAFTER_TARGET=spec.drafter_target,
                   DSPARK_STARTUP_TIMEOUT_S="300", OMP_NUM_THREADS=str(spec.threads),
                   PYTHONPATH=os.pathsep.join(p for p in (str(spec.root), env.get("PYTHONPATH", "")) if p))
        env.update(spec.env)
        self._env = env
        try:
            for name in SERVICES:  # the gateway last: it asks both backends for their identity at start
                self._spawn(name)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str) -> None:
        """Start service `name`'s child (its log appended to). Raises OSError."""
        spec = self.spec
        ckpt = ["--checkpoint", spec.checkpoint] if spec.checkpoint else []
        cmd = [sys.executable, "-m", "services.cli", "serve", name, "--port", str(spec.ports[name]), *ckpt]
        cmd += ["--tp", str(spec.tp)] if name == "verifier" and spec.tp > 1 else []
        cmd += list(spec.drafter_args) if name == "drafter" else []
        if name == "gateway" and spec.record_rounds is not None:
            cmd += ["--record-rounds", str(spec.record_rounds)]
        with open(self.log_path(name), "ab") as log:
            self.procs[name] = subprocess.Popen(cmd, env=self._env, cwd=spec.root, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        set_session_nice(self.procs[name].pid, os.getpriority(os.PRIO_PROCESS, 0))

    def restart_gateway(self, timeout_s: float = 30.0) -> None:
        """Stop the gateway (SIGTERM, then SIGKILL after timeout_s) and start a new one: a gateway
        process with nothing learned (gates, regime, warm start). Wait with `wait_serving`.
        Raises OSError when it cannot be started."""
        p = self.procs["gateway"]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self._spawn("gateway")

    def log_path(self, name: str) -> Path:
        return self.spec.log_dir / f"{name}-{self.spec.ports[name]}.log"

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_path(name)
        text = path.read_text(errors="replace") if path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def exited(self) -> dict[str, int]:
        """{service: exit status} of the children that have ended (empty while all run)."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    async def wait_serving(self, timeout_s: float = 600.0) -> float:
        """Wait until the gateway reports SERVING; returns the seconds waited.

        Raises:
            RuntimeError: a child exited first (its log tail included), or the gateway was not
                SERVING within timeout_s (s).
        """
        t0 = deadline = time.monotonic()
        deadline += timeout_s
        async with grpc.aio.insecure_channel(self.spec.gateway_target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                dead = self.exited()
                if dead:
                    name, rc = next(iter(dead.items()))
                    raise RuntimeError(f"{name} exited with status {rc} before the gateway served:\n"
                                       f"{self.log_tail(name)}")
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(service="dspark.v1.Gateway"), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - t0
                except grpc.aio.AioRpcError:
                    pass  # not bound yet, or still profiling the round costs
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway {self.spec.gateway_target} not SERVING within {timeout_s:g} s")
                await asyncio.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every child (gateway first, so no new round reaches the backends), wait up to
        timeout_s (s) each, then SIGKILL its process group."""
        for name in reversed(SERVICES):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def set_session_nice(pid: int, nice: int) -> bool:
    """Give the session of process `pid` (its scheduler autogroup) the niceness `nice` (-20..19).

    Why: Linux with autogroups (`/proc/sys/kernel/sched_autogroup_enabled` = 1, this box's
    default) first shares the cores fairly between sessions, and only then by each process's
    own nice within a session. A child started in a session of its own (every service here)
    keeps the process niceness `nice -n` gave its parent, which then decides nothing against
    other sessions' work: a benchmark run at `nice -n -20` still got half a core less beside
    two other sessions' jobs at `nice -n 19` (docs/simulate.md §5.2). The session's niceness
    is what orders sessions. Returns False (and changes nothing) where the process is in no
    autogroup (the kernel has none, they are disabled, or it runs in a cgroup of its own, as
    in most containers: the file then reads empty and its niceness would decide nothing) or
    the kernel refuses (a negative niceness needs root); True when set."""
    try:
        with open(f"/proc/{pid}/autogroup", encoding="ascii") as f:
            if not f.read().strip():
                return False
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        return True
    except OSError:
        return False


def may_lower_nice(nice: int) -> bool:
    """Whether this process may start children at niceness `nice` (< 0 lowers it): it holds
    CAP_SYS_NICE (/proc/self/status CapEff bit 23; root in a container may not) or RLIMIT_NICE
    allows it. Without either, `nice -n -20` warns and runs the child at 0, and the session's
    niceness is refused: the stages would be measured unprotected from other sessions' work
    (docs/simulate.md §5.2) with nothing but a warning on the terminal."""
    if nice >= 0:
        return True
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]  # allows nice down to 20 - limit
    return bool(caps >> 23 & 1) or limit == resource.RLIM_INFINITY or limit >= 20 - nice


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (bytes): psutil when installed, else /proc/<pid>/status.

    Raises:
        ProcessLookupError: no such process (it exited).
    """
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            raise ProcessLookupError(f"pid {pid}: no such process") from None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except FileNotFoundError:
        raise ProcessLookupError(f"pid {pid}: no such process") from None
    raise ProcessLookupError(f"pid {pid}: no VmRSS line (a zombie)")


def run_bench(run, args) -> None:
    """A benchmark's entry: `run(args, env)` (a coroutine returning the exit code) on a new
    event loop, with the environment read once here and passed down. SIGTERM stops it as
    Ctrl-C does, so `run`'s clean-up stops the service processes (they run in their own
    sessions and would otherwise outlive a killed benchmark). Exits with run's code."""
    env = dict(os.environ)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(asyncio.run(run(args, env)))
