"""The prepared services check of a GPU session (`python -m bench.gpu_check --services`),
run whole on the CPU by its dry run: three `dspark serve` processes with DSPARK_DEVICE=cpu,
exactness of speculation against plain decode, and the step-table file it writes, for the
bundled model and then the V4-Flash-shaped random checkpoint at toy sizes (a second stack).

Slow (56-88 s on the shared 2-core CI machine, most of it six processes importing torch
and the exact-numerics forwards): marked slow, so CI's fast run skips it and the full run
covers it. The CI-sized dry run (the V4 stage's checkpoint and checks against in-process
servers) is tests/test_gpu_check_ci.py."""

from __future__ import annotations

import json
import socket

import pytest


STACK_OFFSETS = (0, 1, 2, 20, 21, 22)  # the bundled stack, then the V4 stack at port base + 20


def _free_port_base() -> int:
    """A port p with p + each of STACK_OFFSETS free now (the two stacks' gateway, verifier, drafter)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 65000:
            continue
        socks = [socket.socket() for _ in STACK_OFFSETS]
        try:
            for off, s in zip(STACK_OFFSETS, socks):
                s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port base for the two stacks found")


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
    for name in ("repeat", "code", "prose", "math"):
        assert f"V4: services: {name}: always, gated == plain" in text
    assert "V4: shape" in text and "fp8/fp4; toy dimensions (dry run)" in text
    v4 = json.loads((tmp_path / "table-v4.json").read_text())
    assert v4["model"] == "v4-flash-shaped-1L" and v4["drafter"]["step_ms"] > 0
