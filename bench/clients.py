"""The clients people already use, run against `dspark up`: one row per client, works or fails
and why (issue 36). Not in CI (it installs packages from the registries); CI runs the request
shapes these clients send as fixtures instead.

Starts `dspark up --port-base P` (the random tiny model unless `--checkpoint`) as a child of
its own, waits until the gateway reports SERVING and the HTTP API answers, runs each selected
client against it, stops it (SIGTERM, as Ctrl-C would) and prints one table:
client | result (works / fails / not run) | reason. Exit status 0 when every row that ran works.

Every client is installed apart from the project's environment, under `--workdir` (default
/tmp/dspark-clients; kept between runs, so a second run installs nothing): npm packages in a
folder of their own per client, Python clients in one virtual environment (`client_venv`).
Nothing is installed into the repository.

Rows (`CLIENTS`, by name; `--clients` picks some):

* `node-grpc`: bench/node_client/gateway_client.js with @grpc/grpc-js and @grpc/proto-loader
  (versions in bench/node_client/package.json) over the repository's protos/, the include
  root: a sampled generation, the seed the gateway drew replayed from JavaScript as a number
  (the same tokens), the x-request-id metadata echoed in messages and trailers, a bad request
  INVALID_ARGUMENT with a request id in its trailers.

Extension point: the HTTP clients (`PENDING`: openai, lm-eval, guidellm, aiperf, langchain) are
listed as "not run" until a row is registered for them. A row is a function `(Target, Path)
-> Row` registered with `@client("name")`; it gets the running stack's addresses and a folder
of its own under the workdir, installs what it needs there (Python packages through
`client_venv(workdir, [...])`, which returns the environment's python), and must not raise:
a failure is a Row with works=False and the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
NODE_CLIENT = REPO_ROOT / "bench" / "node_client"
INSTALL_TIMEOUT_S = 600.0   # one npm / pip install
CLIENT_TIMEOUT_S = 300.0    # one client's run
READY_TIMEOUT_S = 300.0     # `dspark up` until the gateway serves and the HTTP API answers


@dataclass(frozen=True)
class Target:
    """The running stack: gateway and verifier gRPC addresses (host:port), the HTTP API's base
    URL (".../v1") and the repository's protos/ folder (the include root)."""

    grpc: str
    verifier: str
    http_base_url: str
    protos: Path


@dataclass(frozen=True)
class Row:
    """One client's result: `works` is None when it did not run (no row registered)."""

    client: str
    works: bool | None
    reason: str

    @property
    def result(self) -> str:
        return {True: "works", False: "fails", None: "not run"}[self.works]


ClientCheck = Callable[[Target, Path], Row]
CLIENTS: dict[str, ClientCheck] = {}
# HTTP clients a row is still to be written for (issue 36 Build 7); each becomes a `@client`.
PENDING = ("openai", "lm-eval", "guidellm", "aiperf", "langchain")


def client(name: str) -> Callable[[ClientCheck], ClientCheck]:
    """Register a row under `name` (the first column of the table)."""
    def register(check: ClientCheck) -> ClientCheck:
        CLIENTS[name] = check
        return check
    return register


def run(cmd: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`cmd` in `cwd` with captured text output; raises subprocess.TimeoutExpired after timeout_s (s)."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)


def tail(text: str, lines: int = 3) -> str:
    """The last `lines` non-empty lines of `text`, joined with " | " (a table cell)."""
    return " | ".join([line for line in text.splitlines() if line.strip()][-lines:])


def client_venv(workdir: Path, packages: list[str]) -> Path:
    """The python of a virtual environment at `workdir`/venv (created on first use, apart from
    the project's) with `packages` (pip requirement strings) installed; returns its path.

    Raises:
        RuntimeError: pip failed (its last lines named).
    """
    env_dir = workdir / "venv"
    python = env_dir / "bin" / "python"
    if not python.exists():
        venv.create(env_dir, with_pip=True)
    if packages:
        res = run([str(python), "-m", "pip", "install", "--quiet", *packages], workdir, INSTALL_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(packages)} failed: {tail(res.stderr)}")
    return python


# ---------------------------------------------------------------------------- rows
@client("node-grpc")
def node_grpc(target: Target, folder: Path) -> Row:
    """bench/node_client/gateway_client.js with its npm packages installed in `folder`."""
    name = "node-grpc (@grpc/grpc-js)"
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        return Row(name, False, f"{' and '.join(missing)} not on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    for file in ("package.json", "gateway_client.js"):
        shutil.copyfile(NODE_CLIENT / file, folder / file)
    try:
        res = run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], folder, INSTALL_TIMEOUT_S)
        if res.returncode != 0:
            return Row(name, False, f"npm install failed: {tail(res.stderr)}")
        versions = run(["node", "-e", "for (const p of ['@grpc/grpc-js', '@grpc/proto-loader'])"
                        " process.stdout.write(p + ' ' + require(p + '/package.json').version + ' ')"],
                       folder, 30).stdout.strip()
        res = run(["node", "gateway_client.js", "--target", target.grpc, "--protos", str(target.protos)],
                  folder, CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return Row(name, False, f"{exc.cmd[0]} did not finish within {exc.timeout:g} s")
    try:
        result = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return Row(name, False, f"no result line (exit {res.returncode}): {tail(res.stderr or res.stdout)}")
    reason = f"{result.get('reason')}; seed {result.get('seed')} replayed from JavaScript; {versions}"
    return Row(name, bool(result.get("ok")) and res.returncode == 0, reason)


# ---------------------------------------------------------------------------- the stack
class Stack:
    """`dspark up --port-base P` as a child process in a session of its own; `stop()` ends it."""

    def __init__(self, port_base: int, checkpoint: str | None, log: Path):
        cmd = [sys.executable, "-m", "services.cli", "up", "--port-base", str(port_base)]
        if checkpoint:
            cmd += ["--checkpoint", checkpoint]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                          if p))
        self.log_path = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.target = Target(f"127.0.0.1:{port_base}", f"127.0.0.1:{port_base + 1}",
                             f"http://127.0.0.1:{port_base + 3}/v1", REPO_ROOT / "protos")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the gateway is SERVING on grpc.health.v1 and GET /v1/models answers 200.

        Raises:
            RuntimeError: `dspark up` exited first (its log's tail included) or timeout_s passed.
        """
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"dspark up exited with {self.proc.returncode}: "
                                       f"{tail(self.log_path.read_text(errors='replace'), 5)}")
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service="dspark.v1.Gateway"), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        with urllib.request.urlopen(f"{self.target.http_base_url}/models", timeout=5) as r:
                            if r.status == 200:
                                return
                except (grpc.RpcError, OSError):
                    pass  # still loading
                time.sleep(0.5)
        raise RuntimeError(f"dspark up not ready within {timeout_s:g} s (log: {self.log_path})")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (dspark up then stops its three services), SIGKILL of the group after timeout_s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table: client | result | reason."""
    lines = ["| client | result | reason |", "|---|---|---|"]
    lines += [f"| {r.client} | {r.result} | {r.reason.replace('|', '/')} |" for r in rows]
    return "\n".join(lines)


def check_all(names: list[str], target: Target, workdir: Path) -> list[Row]:
    """Run the registered rows in `names` (in that order); the others are "not run" rows."""
    rows = []
    for name in names:
        check = CLIENTS.get(name)
        if check is None:
            rows.append(Row(name, None, "no row yet (bench/clients.py: register one with @client)"))
            continue
        t0 = time.monotonic()
        try:
            row = check(target, workdir / name)
        except Exception as exc:  # a row must not take the others down with it
            row = Row(name, False, f"the row raised {type(exc).__name__}: {exc}")
        rows.append(Row(row.client, row.works, f"{row.reason} ({time.monotonic() - t0:.0f} s)"))
        print(f"{row.client}: {row.result}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port-base", type=int, default=50300,
                    help="dspark up's gateway port (verifier + 1, drafter + 2, HTTP + 3)")
    ap.add_argument("--checkpoint", default=None, help="model folder (default: the random tiny model)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dspark-clients"),
                    help="where the clients are installed (outside the repository; kept between runs)")
    ap.add_argument("--clients", nargs="+", default=[*CLIENTS, *(p for p in PENDING if p not in CLIENTS)],
                    help="rows to run, by name (default: all, the pending ones as 'not run')")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    unknown = [n for n in args.clients if n not in CLIENTS and n not in PENDING]
    if unknown:
        ap.error(f"--clients: unknown {unknown}; known: {sorted({*CLIENTS, *PENDING})}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.port_base, args.checkpoint, args.workdir / f"dspark-up-{args.port_base}.log")
    try:
        stack.wait_ready()
        rows = check_all(args.clients, stack.target, args.workdir)
    finally:
        stack.stop()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0 if all(r.works is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
