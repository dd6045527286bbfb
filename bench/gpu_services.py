"""The services on a GPU: `python -m bench.gpu_check --services [--dry-run] [--out FILE]`.

Owns the end-to-end device check of the three services (docs/deployment.md §4): it starts a
verifier and a drafter with `DSPARK_DEVICE` set (cuda:0; the CPU under `--dry-run`) and a
gateway, as separate `dspark serve` processes (`bench.service_procs`), with exact verify
numerics, and through the gateway's public API:

1. runs the demo's four prompts (bench_services.WORKLOADS) greedily with speculation off,
   always and gated, and checks that every speculative output equals plain decode's;
2. runs 1, 4, 16 and 64 concurrent streams (dry run: 1 and 4) of always-speculated
   generations and checks each equals its prompt's plain output, with aggregate tok/s;
3. reads the verifier's measured batch-step table and the drafter's step time (`Info`) and
   writes them as a step-table file (format below) a simulator reads, so its `gpu` shape can
   be a measurement instead of a roofline model;
4. checks TP = 2 over NCCL where two CUDA devices exist (a TP = 2 verifier's plain output
   equals the TP = 1 one's tokens), and reports one clear skip line where they do not;
5. repeats 1-3 on a random checkpoint of V4-Flash's real shape and formats, with as many
   trunk layers as fit 70 GB beside the drafter (`bench.gpu_v4`: 1 layer; the dry run: the
   same structure at toy sizes), its step tables in `<out>-v4.json`.

Step-table file (JSON), times in ms per step of the whole batch:
    {"device": "NVIDIA H100 80GB HBM3", "model": "dspark-small",
     "verifier": {"rows": [1.0, 2.0, ...], "ms": [3.1, 3.4, ...], "samples": [40, 12, ...]},
     "drafter": {"step_ms": 4.2, "sessions_per_step": 3.1}}
`verifier.rows` ascending, `ms` non-decreasing (the verifier's own monotone fit); the
drafter's step holds its sessions' commits and drafts together (one batched forward each).

It asserts nothing about time; a failed exactness check is a FAIL row and exit status 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.bench_services import WORKLOADS
from bench.service_procs import REPO_ROOT, ServiceProcesses, StackSpec
from dspark_proto.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc

BUNDLED = REPO_ROOT / "assets" / "dspark-small"
SPECS = {"off": gateway_pb2.SPEC_MODE_OFF, "always": gateway_pb2.SPEC_MODE_ALWAYS,
         "gated": gateway_pb2.SPEC_MODE_GATED}
CALL_TIMEOUT_S = 300.0


def _equal(rep, name: str, same: bool, value: str) -> None:
    """A bitwise-equality row of gpu_check's Report, with a figure beside it."""
    rep.rows.append((name, value, "equal", "ok" if same else "FAIL"))


async def generate(stub, prompt: str, spec: str, max_tokens: int) -> list[int]:
    """The token ids of one greedy generation through the gateway (ignore_eos)."""
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, spec=SPECS[spec], ignore_eos=True,
                                      label="gpu_check")
    tokens: list[int] = []
    async for msg in stub.Generate(req, timeout=CALL_TIMEOUT_S):
        tokens.extend(msg.token_ids)
    return tokens


async def check_prompts(stub, rep, max_tokens: int) -> dict[str, list[int]]:
    """Section 1: the four prompts off / always / gated; returns each prompt's plain tokens."""
    plain = {}
    for name, prompt in WORKLOADS.items():
        outs = {spec: await generate(stub, prompt, spec, max_tokens) for spec in SPECS}
        plain[name] = outs["off"]
        same = all(outs[s] == outs["off"] for s in ("always", "gated"))
        _equal(rep, f"services: {name}: always, gated == plain", same, f"{len(outs['off'])} tokens")
    return plain


async def check_streams(stub, rep, plain: dict[str, list[int]], streams: list[int], max_tokens: int) -> None:
    """Section 2: N concurrent always-speculated generations, each equal to its plain output."""
    names = list(WORKLOADS)
    for n in streams:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(generate(stub, WORKLOADS[names[i % 4]], "always", max_tokens)
                                      for i in range(n)))
        wall = time.perf_counter() - t0
        same = all(out == plain[names[i % 4]] for i, out in enumerate(outs))
        tok = sum(len(o) for o in outs)
        _equal(rep, f"services: {n} streams, always == plain", same, f"{tok / wall:.1f} tok/s aggregate")


async def step_tables(spec) -> dict:
    """Section 3: the verifier's batch-step table and the drafter's step time, from `Info`;
    spec: anything with `verifier_target` and `drafter_target` (a StackSpec, a `Targets`)."""
    async with grpc.aio.insecure_channel(spec.verifier_target) as v, \
            grpc.aio.insecure_channel(spec.drafter_target) as d:
        vi = await verifier_pb2_grpc.VerifierStub(v).Info(common_pb2.InfoRequest(), timeout=30)
        di = await drafter_pb2_grpc.DrafterStub(d).Info(common_pb2.InfoRequest(), timeout=30)
    return {"verifier": {"rows": list(vi.step_table_rows), "ms": list(vi.step_table_ms),
                         "samples": list(vi.step_table_samples), "source": vi.step_table_source},
            "drafter": {"step_ms": di.drafter_step_ms_mean, "sessions_per_step": di.drafter_batch_size_mean}}


@dataclass(frozen=True)
class Targets:
    """Where a running stack listens ("host:port" each): what sections 1-3 talk to."""

    gateway_target: str
    verifier_target: str
    drafter_target: str


async def run_checks(targets, rep, streams: list[int], max_tokens: int) -> dict:
    """Sections 1-3 against a running stack (`Targets` or a StackSpec); returns its step tables."""
    async with grpc.aio.insecure_channel(targets.gateway_target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        plain = await check_prompts(stub, rep, max_tokens)
        await check_streams(stub, rep, plain, streams, max_tokens)
    return await step_tables(targets)


async def run_stack(spec: StackSpec, rep, streams: list[int], max_tokens: int) -> dict:
    """Start one stack of `dspark serve` processes, run sections 1-3 on it, stop it; returns
    its step tables."""
    procs = ServiceProcesses(spec, dict(os.environ))
    try:
        waited = await procs.wait_serving(timeout_s=600)
        rep.info("services: start-up", f"{waited:.1f} s")
        return await run_checks(spec, rep, streams, max_tokens)
    finally:
        procs.stop()


def device_for(dry_run: bool) -> str:
    """Where verifier and drafter run: the first GPU, or the CPU in the dry run."""
    return "cpu" if dry_run else "cuda:0"


def stack_spec(port_base: int, log_dir: Path, device: str, profile: bool = True) -> StackSpec:
    """The bundled model's stack on `device`, exact numerics (speculation == plain bitwise);
    profile: the verifier's start-up step profile (off in the dry run, where it dominates)."""
    env = (("DSPARK_DEVICE", device), ("DSPARK_STEP_PROFILE", "1" if profile else "0"))
    return StackSpec(checkpoint=str(BUNDLED), port_base=port_base, log_dir=log_dir,
                     verify_numerics="exact", max_sessions=80, env=env)


def check_services(rep, dry_run: bool, port_base: int, out: Path, log_dir: Path) -> None:
    """Every section on the bundled model (see the module docstring), then TP = 2; writes
    `out`. The V4-Flash-shaped stage (section 5) is `bench.gpu_v4.check_v4`, run after this."""
    import torch

    streams = [1, 4] if dry_run else [1, 4, 16, 64]
    max_tokens = 4 if dry_run else 32
    spec = stack_spec(port_base, log_dir, device_for(dry_run), profile=not dry_run)
    tables = asyncio.run(run_stack(spec, rep, streams, max_tokens))
    name = "cpu (dry run)" if dry_run else torch.cuda.get_device_name(0)
    record = {"device": name, "model": BUNDLED.name, **tables}
    out.write_text(json.dumps(record, indent=1) + "\n")
    v = tables["verifier"]
    rep.info("services: verifier step table (rows: ms)",
             ", ".join(f"{r:g}: {m:.2f}" for r, m in zip(v["rows"], v["ms"])) or "empty")
    rep.info("services: drafter step ms (commits + drafts)", f"{tables['drafter']['step_ms']:.2f}")
    rep.info("services: step-table file", str(out))
    check_tp2(rep, dry_run, port_base + 10, log_dir, max_tokens)


def check_tp2(rep, dry_run: bool, port_base: int, log_dir: Path, max_tokens: int) -> None:
    """Section 4: a TP = 2 verifier over NCCL (rank r on cuda:r) serves the four prompts, with
    speculation equal to plain decode (sequential verify: each draft checked by a decode
    forward, so the equality is bitwise in fast numerics too); a skip line without 2 GPUs."""
    import torch

    found = 0 if dry_run else torch.cuda.device_count()
    if found < 2:
        rep.info("services: TP=2 over NCCL", f"skipped: needs 2 CUDA devices, found {found}")
        return
    spec = StackSpec(checkpoint=str(BUNDLED), port_base=port_base, log_dir=log_dir, verify_numerics="fast",
                     max_sessions=16, tp=2, env=(("DSPARK_DEVICE", "cuda:0"), ("DSPARK_VERIFY_MODE", "sequential")))
    asyncio.run(run_stack(spec, Prefixed(rep, "TP=2 "), [4], max_tokens))


class Prefixed:
    """A Report view that prefixes every row name (the TP=2 stack's rows)."""

    def __init__(self, rep, prefix: str):
        self.rep, self.prefix, self.rows = rep, prefix, PrefixedRows(rep.rows, prefix)

    def info(self, name: str, value: str) -> None:
        self.rep.info(self.prefix + name, value)


class PrefixedRows:
    def __init__(self, rows: list, prefix: str):
        self.target, self.prefix = rows, prefix

    def append(self, row: tuple) -> None:
        self.target.append((self.prefix + row[0], *row[1:]))
