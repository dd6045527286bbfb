"""What every row of `bench.clients` shares: the running stack's addresses (`Target`), a row's
result (`Row`), the registry of rows (`@client`), subprocess helpers and the clients' own
virtual environment (`client_venv`, with the pinned Python clients, `PYTHON_CLIENTS`).

Kept apart from bench/clients.py so that the row modules (bench/client_rows.py) register
into the one registry whether bench.clients runs as `__main__` or is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED = REPO_ROOT / "assets" / "dspark-small"
INSTALL_TIMEOUT_S = 1200.0  # one npm / pip install (the Python clients' first install takes minutes)
CLIENT_TIMEOUT_S = 900.0    # one client's run (lm-eval's and the exact in-process scoring take minutes on 2 busy cores)

# The Python clients, pinned (the newest releases on 2026-12-06 that install together on Python
# 3.11; the issue-36 report used these). torch is guidellm's dependency: pinned to the project's
# own torch so that a local CPU wheel is taken where there is one.
PYTHON_CLIENTS = ("openai==3.63.0", "lm-eval==0.4.13", "guidellm==0.8.1", "aiperf==0.13.0",
                  "langchain-openai==1.8.1", "torch==2.13.0")


@dataclass(frozen=True)
class Target:
    """The running stack: gateway and verifier gRPC addresses (host:port), the HTTP API's base
    URL (".../v1"), the repository's protos/ folder (the include root), the served model's id
    (what /v1/models lists), its checkpoint folder (None: the random tiny model) and the
    verifier's numerics ("fast" / "exact", DSPARK_VERIFY_NUMERICS)."""

    grpc: str
    verifier: str
    http_base_url: str
    protos: Path
    model_id: str = ""
    checkpoint: Path | None = None
    numerics: str = "fast"

    @property
    def http_root(self) -> str:
        """The HTTP server's root URL (no /v1): where guidellm and aiperf want to be pointed."""
        return self.http_base_url.removesuffix("/v1")


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
_INSTALLED: set[tuple[Path, tuple[str, ...]]] = set()


def client(name: str) -> Callable[[ClientCheck], ClientCheck]:
    """Register a row under `name` (the first column of the table)."""
    def register(check: ClientCheck) -> ClientCheck:
        CLIENTS[name] = check
        return check
    return register


def run(cmd: list[str], cwd: Path, timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`cmd` in `cwd` with captured text output (env: the whole environment, None: ours);
    raises subprocess.TimeoutExpired after timeout_s (s)."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)


def tail(text: str, lines: int = 3) -> str:
    """The last `lines` non-empty lines of `text`, joined with " | " (a table cell)."""
    return " | ".join([line for line in text.splitlines() if line.strip()][-lines:])


def client_venv(workdir: Path, packages: list[str] | tuple[str, ...] = PYTHON_CLIENTS) -> Path:
    """The python of a virtual environment at `workdir`/venv (created on first use, apart from
    the project's) with `packages` (pip requirement strings) installed; returns its path. A
    second call finds them installed (`pip install` of satisfied pins is quick).

    Raises:
        RuntimeError: pip failed (its last lines named).
        subprocess.TimeoutExpired: pip ran past INSTALL_TIMEOUT_S.
    """
    env_dir = workdir / "venv"
    python = env_dir / "bin" / "python"
    key = (env_dir, tuple(packages))
    if key in _INSTALLED:  # one pip run per process: every row asks
        return python
    if not python.exists():
        venv.create(env_dir, with_pip=True)
    if packages:
        res = run([str(python), "-m", "pip", "install", "--quiet", *packages], workdir, INSTALL_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(packages)} failed: {tail(res.stderr)}")
    _INSTALLED.add(key)
    return python


def versions(python: Path, dists: list[str]) -> str:
    """"name version" of each installed distribution in `python`'s environment, space-joined."""
    code = ("import importlib.metadata as m, sys\n"
            "print(' '.join(f'{d} {m.version(d)}' for d in sys.argv[1:]))")
    return run([str(python), "-c", code, *dists], REPO_ROOT, 60).stdout.strip()


def result_line(name: str, res: subprocess.CompletedProcess) -> Row:
    """The Row a check script reported as its last stdout line, JSON {"ok": bool, "reason": str};
    a missing or unreadable line is a failing Row naming the exit status and the output's tail."""
    try:
        result = json.loads(res.stdout.strip().splitlines()[-1])
        return Row(name, bool(result["ok"]) and res.returncode == 0, str(result["reason"]))
    except (IndexError, KeyError, TypeError, json.JSONDecodeError):
        return Row(name, False, f"no result line (exit {res.returncode}): {tail(res.stderr or res.stdout)}")


def project_python() -> str:
    """The project's interpreter (the one running the bench): in-process scoring runs there."""
    return sys.executable
