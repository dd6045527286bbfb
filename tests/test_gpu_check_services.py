"""The prepared services check of a GPU session (`python -m bench.gpu_check --services`),
run whole on the CPU by its dry run: three `dspark serve` processes with DSPARK_DEVICE=cpu,
exactness of speculation against plain decode, and the step-table file it writes.

Slow (about 40-50 s on the shared 2-core CI machine, most of it three processes importing
torch and the exact-numerics forwards of the bundled model): marked slow, so CI's fast run
skips it and the full run covers it."""

from __future__ import annotations

import json
import socket

import pytest


def _free_port_base() -> int:
    """A port p with p .. p + 2 free now (the gateway, verifier and drafter of the stack)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 65000:
            continue
        try:
            socks = [socket.socket() for _ in range(3)]
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no three consecutive free ports found")


@pytest.mark.slow
def test_services_dry_run_serves_exactly_and_writes_the_step_table(tmp_path, capsys):
    from bench.gpu_check import main

    out = tmp_path / "table.json"
    code = main(["--services", "--dry-run", "--port-base", str(_free_port_base()), "--out", str(out),
                 "--log-dir", str(tmp_path / "logs")])
    text = capsys.readouterr().out
    assert code == 0, text
    assert ", 0 failed" in text
    for name in ("repeat", "code", "prose", "math"):
        assert f"services: {name}: always, gated == plain" in text
    assert "services: 4 streams, always == plain" in text
    assert "TP=2 over NCCL" in text and "skipped: needs 2 CUDA devices, found 0" in text
    table = json.loads(out.read_text())
    rows, ms = table["verifier"]["rows"], table["verifier"]["ms"]
    assert rows and len(rows) == len(ms) and rows == sorted(rows) and ms == sorted(ms)
    assert table["drafter"]["step_ms"] > 0 and table["device"] == "cpu (dry run)"
