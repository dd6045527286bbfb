"""The clients people already use, run against `dspark up`: one row per client, works or fails
and why (issue 36). Not in CI (it installs packages from the registries); CI runs the request
shapes these clients send as fixtures instead (tests/test_http_clients.py).

Starts `dspark up --port-base P` (the bundled assets/dspark-small unless `--checkpoint`; exact
verifier numerics unless `--numerics fast`) as a child of its own, waits until the gateway
reports SERVING and the HTTP API answers, runs each selected client against it, stops it
(SIGTERM, as Ctrl-C would) and prints one table: client | result (works / fails) | reason.
Exit status 0 when every row works.

Every client is installed apart from the project's environment, under `--workdir` (default
/tmp/dspark-clients; kept between runs, so a second run installs nothing): npm packages in a
folder of their own, the Python clients in one virtual environment (`client_kit.client_venv`,
pins in `client_kit.PYTHON_CLIENTS`). Nothing is installed into the repository, and nothing
is downloaded from a model hub (the clients load the checkpoint folder as their tokenizer).

Rows (`--clients` picks some, in `ORDER`):

* `openai`, `langchain`, `lm-eval`, `guidellm`, `aiperf`: bench/client_rows.py (what each
  checks is in its docstring; lm-eval's multiple-choice scores are compared with the model's
  own logits in process by bench/lm_eval_score.py).
* `node-grpc`: bench/node_client/gateway_client.js with @grpc/grpc-js and @grpc/proto-loader
  (versions in bench/node_client/package.json) over the repository's protos/, the include
  root: a sampled generation, the seed the gateway drew replayed from JavaScript as a number
  (the same tokens), the x-request-id metadata echoed in messages and trailers, a bad request
  INVALID_ARGUMENT with a request id in its trailers.

A row is a function `(Target, Path) -> Row` registered with `@client("name")`
(bench/client_kit.py); it gets the running stack's addresses and a folder of its own under the
workdir and must not raise: a failure is a Row with works=False and the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.client_rows import HTTP_ROWS  # importing it registers the HTTP clients' rows
from bench.client_kit import (CLIENTS, INSTALL_TIMEOUT_S, CLIENT_TIMEOUT_S, BUNDLED, REPO_ROOT, Row, Target,
                              client, run, tail)

# The table's order: the HTTP clients as a new user meets them, then the gRPC client.
ORDER = (*HTTP_ROWS, "node-grpc")
NODE_CLIENT = REPO_ROOT / "bench" / "node_client"
READY_TIMEOUT_S = 300.0     # `dspark up` until the gateway serves and the HTTP API answers


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

    def __init__(self, port_base: int, checkpoint: Path | None, log: Path, numerics: str = "fast"):
        cmd = [sys.executable, "-m", "services.cli", "up", "--port-base", str(port_base)]
        if checkpoint:
            cmd += ["--checkpoint", str(checkpoint)]
        env = dict(os.environ, DSPARK_VERIFY_NUMERICS=numerics, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                          if p))
        self.log_path = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.target = Target(f"127.0.0.1:{port_base}", f"127.0.0.1:{port_base + 1}",
                             f"http://127.0.0.1:{port_base + 3}/v1", REPO_ROOT / "protos", checkpoint=checkpoint,
                             numerics=numerics)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the gateway is SERVING on grpc.health.v1 and GET /v1/models answers 200; then
        `target` carries the served model's id.

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
                                model_id = json.loads(r.read())["data"][0]["id"]
                                self.target = dataclasses.replace(self.target, model_id=model_id)
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
    """Run the registered rows `names` (in that order); a row that raises is a failing row."""
    rows = []
    for name in names:
        check = CLIENTS[name]
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
    ap.add_argument("--checkpoint", type=Path, default=BUNDLED,
                    help="model folder (default: the bundled assets/dspark-small, whose folder lm-eval, "
                         "guidellm and aiperf load as their tokenizer)")
    ap.add_argument("--numerics", choices=("exact", "fast"), default="exact",
                    help="the verifier's DSPARK_VERIFY_NUMERICS; exact (default) makes lm-eval's multiple-choice "
                         "scores bitwise comparable with the in-process ones")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dspark-clients"),
                    help="where the clients are installed (outside the repository; kept between runs)")
    ap.add_argument("--clients", nargs="+", default=list(ORDER), choices=ORDER, metavar="NAME",
                    help=f"rows to run, by name (default: all: {' '.join(ORDER)})")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.port_base, args.checkpoint, args.workdir / f"dspark-up-{args.port_base}.log", args.numerics)
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
